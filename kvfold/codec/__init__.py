"""The wire format: msgpack maps with a schema version, validated on the way in.

    kvfold.codec.rank   rank reports (rank -> its node's host-KV actor)
    kvfold.codec.node   node reports (node actor -> cluster aggregator)
    kvfold.codec.fields the schema version, limits, refusal reasons, field validators

`decode_*` never raises anything but ReportError (with a reason code), whatever the
bytes; a refused report changes nothing. No pickle anywhere on this path.
"""

from kvfold.codec.fields import (
    MAX_REPORT_BYTES,
    REASONS,
    SCHEMA_VERSION,
)
from kvfold.codec.node import NodeReport, decode_node_report, encode_node_report
from kvfold.codec.rank import decode_rank_report, encode_rank_report

__all__ = [
    "MAX_REPORT_BYTES",
    "REASONS",
    "SCHEMA_VERSION",
    "NodeReport",
    "decode_node_report",
    "decode_rank_report",
    "encode_node_report",
    "encode_rank_report",
]
