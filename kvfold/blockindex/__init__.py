"""The cluster block index: which ranks hold which prefix blocks, fed by the block events
of kvfold.kvevents.

    kvfold.blockindex.index         BlockIndex: key -> holders; longest-prefix match per rank
    kvfold.blockindex.match         the answer: per rank, the prompt blocks it could reuse
    kvfold.blockindex.prompt_match  a prompt's keys matched against the index
    kvfold.blockindex.feed          per-source streams: sequence numbers, gaps, snapshots;
                                    the op log replicas (each controller's copy) follow
    kvfold.blockindex.liveness      which sources the index still credits
    kvfold.blockindex.client        a reader's calls to the aggregator's index (Ray)

Pure but for the client. The aggregator holds the authoritative index
(kvfold.aggregator); controllers hold replicas (docs/routing.md).
"""
