"""The KV-event layer every cache speaks: what a block pool gained and lost, as vLLM's KV
events, and how a source's stream is numbered and resynced. Ranks, engine ranks and host
tiers write it; the block index (kvfold.blockindex) and the aggregator read it.

    kvfold.kvevents.events    vLLM-shaped KV events and their envelope (msgpack)
    kvfold.kvevents.journal   what one cache's keys gained and lost, compacted per batch
    kvfold.kvevents.snapshot  a source's keys taken whole, for a resync

Pure: no Ray.
"""
