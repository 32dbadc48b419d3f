"""The node and cluster side: host tier, node fold, cluster fold, freshness (pure cores),
and the node and cluster actors and the client (Ray shells, imported on their own).

Import submodules directly (`from kvfold.aggregator.fold import fold_node`); this
package imports nothing so that the aggregator process never loads torch.
"""
