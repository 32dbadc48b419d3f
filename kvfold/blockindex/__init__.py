"""The cluster block index: which ranks hold which prefix blocks, fed by block events.

    kvfold.blockindex.events   vLLM-shaped KV events and their envelope (msgpack)
    kvfold.blockindex.journal  what one cache's keys gained and lost, compacted per batch
    kvfold.blockindex.index    BlockIndex: key -> holders; longest-prefix match per rank
    kvfold.blockindex.match    the answer: per rank, the prompt blocks it could reuse
    kvfold.blockindex.feed     per-source streams: sequence numbers, gaps, snapshots;
                               the op log replicas (each controller's copy) follow

Pure: no Ray. The aggregator holds the authoritative index (kvfold.aggregator);
controllers hold replicas (docs/routing.md).
"""
