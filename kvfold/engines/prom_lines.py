"""The lines of a Prometheus exposition that a reader wants, before it is parsed. Pure.

    families_query(samples)        ?name[]=...: the page restricted to these samples, where
                                   the server is prometheus_client's (vLLM's /metrics is)
    wanted_lines(text, families)   the samples and # HELP / # TYPE lines of `families`

An engine's /metrics page is mostly histogram buckets kvfold never reads: vLLM's is about
600 lines, 50 KB, and prometheus_client's parser took 18 ms over it here, 10 times a second
per rank. Parsing only the families read gives the same numbers for a few lines' work; a
server that ignores the query sends the whole page, and the filter keeps the same lines.
"""

from __future__ import annotations

from urllib.parse import urlencode


def families_query(samples: tuple[str, ...]) -> str:
    """The query that asks a prometheus_client server for these samples only."""
    return "?" + urlencode([("name[]", s) for s in samples])


def wanted_lines(text: str, families: tuple[str, ...]) -> str:
    """The lines of `families` (their samples, by name prefix, and their comments), joined.
    A page with text but none of them is not the page asked for: callers refuse it."""
    keep = families + tuple(f"# {kind} {f} " for f in families for kind in ("HELP", "TYPE"))
    return "\n".join(line for line in text.split("\n") if line.startswith(keep)) + "\n"


__all__ = ["families_query", "wanted_lines"]
