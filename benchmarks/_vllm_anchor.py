"""vLLM 0.33.0's own prefix-cache block pool, run in this process as a benchmark anchor.

vLLM is neither a dependency of kvfold nor vendored here. The first use runs
``<python> -m pip download vllm==0.33.0 --no-deps`` into a cache folder outside the
repository (``$KVFOLD_BENCH_CACHE/vllm-0.33.0``, default ``~/.cache/kvfold/bench/vllm-0.33.0``),
checks the few ``.py`` files needed against the wheel's RECORD, extracts only those (once;
later runs reuse them and re-check their digests), and loads them. Anything that stops this
(no network, pip failing, a missing package, an import error) raises `AnchorUnavailable`, so
a benchmark can print ``skipped: <reason>`` and go on.

What runs is vLLM's, unmodified
-------------------------------
* ``vllm/v1/core/block_pool.py``: ``BlockPool`` (``get_new_blocks``, ``cache_full_blocks``,
  ``get_cached_block``, ``touch``, ``free_blocks``, eviction of cached blocks on reuse) and
  ``BlockHashToBlockMap``.
* ``vllm/v1/core/kv_cache_utils.py``: ``KVCacheBlock``, ``FreeKVCacheBlockQueue`` (the free
  block queue / LRU order), ``get_request_block_hasher``, ``hash_block_tokens``,
  ``init_none_hash``, ``generate_block_hash_extra_keys``, ``make_block_hash_with_group_id``,
  ``resolve_block_hashes``, ``trim_null_head``.
* ``vllm/utils/hashing.py``: the prefix-caching hash functions (``sha256`` = pickle +
  SHA-256, the default; ``sha256_cbor``; ``xxhash``; ``xxhash_cbor``) and
  ``get_hash_fn_by_name``.
* ``vllm/utils/math_utils.py``: ``cdiv``.
* ``ConstantList`` from ``vllm/v1/utils.py`` (the type of ``Request.all_token_ids``, which the
  hasher slices): only that class is compiled from the file, because the rest of the module
  imports uvloop, zmq and vLLM's engine.

The hash function is the one vLLM's engine core picks from
``CacheConfig.prefix_caching_hash_algo`` (``vllm/config/cache.py``, default ``"sha256"``; read
from that file, not assumed), wired the way ``EngineCore.__init__``
(``vllm/v1/engine/core.py``) does it: ``get_hash_fn_by_name`` -> ``init_none_hash`` ->
``get_request_block_hasher(block_size, fn)``. ``sha256_cbor`` and ``xxhash_cbor`` need the
``cbor2`` package, ``xxhash``/``xxhash_cbor`` the ``xxhash`` package; if the one an algorithm
needs is not installed, `AnchorUnavailable` names it (nothing is installed).

What is stubbed, and why that does not change what is measured
----------------------------------------------------------------
The two modules import parts of vLLM that need torch, msgspec, zmq, pydantic and vLLM's
engine. While the files above execute, minimal stand-ins sit in ``sys.modules`` under
``vllm.*``; afterwards every ``vllm``/``vllm.*`` entry is removed again (and any that were
there before, e.g. a real vLLM, are put back), so nothing else in the process sees them. The
loaded modules keep their own references. Every stand-in is either never reached on the
measured paths (and raises if it is) or trivial:

* package ``__init__`` modules ``vllm``, ``vllm.utils``, ``vllm.v1``, ``vllm.v1.core``,
  ``vllm.distributed``, ``vllm.multimodal``: empty (the real ones import torch and set up the
  engine; ``vllm/v1/__init__.py`` and ``vllm/v1/core/__init__.py`` are empty anyway).
* ``vllm.logger.init_logger``: a plain ``logging`` logger (with the ``*_once`` methods).
* ``vllm.envs``: only ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (= False), read only when KV
  cache events are published; they are off, as by default.
* ``vllm.distributed.kv_events``: ``MEDIUM_GPU`` (its value read from the wheel's file) and
  the event classes, which are built only when KV cache events are on (they are off).
* ``vllm.multimodal.utils.get_mm_features_in_window``: multimodal requests only.
* ``vllm.v1.core.kv_cache_metrics.KVCacheMetricsCollector``: type only; the pool gets
  ``metrics_collector=None``, as vLLM does unless KV cache metrics are enabled.
* ``vllm.config.VllmConfig``, ``vllm.v1.kv_cache_interface.*``,
  ``vllm.v1.kv_cache_spec_registry.KVCacheSpecRegistry``, ``vllm.v1.request.Request``,
  ``vllm.v1.utils.tensor_data``: used only in annotations or in functions that size the KV
  cache at start-up / hash prompt embeddings, none of which these paths call.
* ``cbor2``, only if it is not installed and the hash algorithm does not use it:
  ``vllm/utils/hashing.py`` imports it at the top, but only ``*_cbor`` call it; the stand-in
  raises if called.

vLLM's ``Request`` (``vllm/v1/request.py``) is not built: constructing it needs
``SamplingParams``, multimodal and engine types (msgspec, pydantic). `_AnchorRequest` carries
exactly the attributes vLLM's code reads on these paths, set as ``Request.__init__`` sets them:
``_all_token_ids`` (a copy of the prompt), ``all_token_ids`` (vLLM's ``ConstantList`` view),
``num_tokens`` (property), ``block_hashes`` (filled at construction by the block hasher, as
``Request.__init__`` -> ``update_block_hashes`` does), ``mm_features`` (``[]``),
``lora_request`` (None), ``cache_salt``, ``prompt_embeds`` (None). ``cache_full_blocks`` reads
only ``block_hashes`` (with events off).

The per-request glue -- what ``FullAttentionManager`` / ``SingleTypeKVCacheManager``
(``vllm/v1/core/single_type_kv_cache_manager.py``) do around the pool for a one-group,
full-attention model under ``UnitaryKVCacheCoordinator`` -- is restated in `VllmPool` line for
line (that module itself needs the torch-heavy ``kv_cache_interface``); see each method.
Left out: the scheduler's admission checks (``get_num_blocks_to_allocate``), the
``KVCacheBlocks`` wrapper objects (no pool or hashing work), and in `fresh` the prefix lookup
vLLM also runs for a request that turns out not to be cached (one ``get_cached_block`` miss).
"""

from __future__ import annotations

import ast
import base64
import csv
import hashlib
import importlib.util
import io
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import types
import typing
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
CACHE_ENV = "KVFOLD_BENCH_CACHE"
PIP_TIMEOUT_S = 1800

# The wheel files extracted. Loaded as modules: the first four. Parsed only: the rest.
_SOURCES = (
    "vllm/utils/math_utils.py",
    "vllm/utils/hashing.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/utils.py",  # ConstantList only
    "vllm/config/cache.py",  # CacheConfig.prefix_caching_hash_algo default, the algo names
    "vllm/distributed/kv_events.py",  # MEDIUM_GPU
    "vllm/_version.py",
)
_MARKER = ".extracted.json"
_LOCK = threading.Lock()


class AnchorUnavailable(RuntimeError):
    """vLLM's block pool could not be fetched or loaded; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------
# Fetching and extracting the wheel
# ---------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where the wheel and its extracted files live (outside the repository)."""
    parent = os.environ.get(CACHE_ENV)
    base = Path(parent).expanduser() if parent else Path.home() / ".cache" / "kvfold" / "bench"
    return base / f"vllm-{VLLM_VERSION}"


def _find_wheel(root: Path) -> Path | None:
    wheels = sorted(root.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return wheels[0] if wheels else None


def _download_wheel(root: Path) -> Path:
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=root))
    except OSError as e:
        raise AnchorUnavailable(f"cannot create cache folder {root}: {e}") from e
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"vllm=={VLLM_VERSION}",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(tmp),
    ]
    try:
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise AnchorUnavailable(f"pip download vllm=={VLLM_VERSION} failed: {e}") from e
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise AnchorUnavailable(
                f"pip download vllm=={VLLM_VERSION} failed (exit {proc.returncode}): {tail}"
            )
        got = _find_wheel(tmp)
        if got is None:
            raise AnchorUnavailable(f"pip download vllm=={VLLM_VERSION} produced no wheel")
        dest = root / got.name
        os.replace(got, dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _extract(wheel: Path, root: Path, src: Path) -> None:
    """Extract `_SOURCES` from the wheel into `src`, checked against the wheel's RECORD."""
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root))
    try:
        try:
            with zipfile.ZipFile(wheel) as z:
                record_name = f"vllm-{VLLM_VERSION}.dist-info/RECORD"
                record = {
                    row[0]: row[1]
                    for row in csv.reader(io.StringIO(z.read(record_name).decode()))
                    if len(row) >= 2
                }
                digests = {}
                for name in _SOURCES:
                    data = z.read(name)
                    digest = _record_digest(data)
                    if record.get(name) != digest:
                        raise AnchorUnavailable(f"{name} in {wheel.name} does not match RECORD")
                    out = tmp / name
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(data)
                    digests[name] = digest
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            wheel.unlink(missing_ok=True)  # a damaged download: fetch it again next time
            raise AnchorUnavailable(f"cannot read {wheel}: {e}") from e
        (tmp / _MARKER).write_text(json.dumps(digests, indent=1))
        shutil.rmtree(src, ignore_errors=True)
        os.replace(tmp, src)
    except OSError:
        pass  # another process put its copy in place first; _extracted_ok decides
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _extracted_ok(src: Path) -> bool:
    """Whether `src` holds exactly `_SOURCES`, byte for byte as extracted from the wheel."""
    try:
        digests = json.loads((src / _MARKER).read_text())
        if sorted(digests) != sorted(_SOURCES):
            return False
        return all(_record_digest((src / n).read_bytes()) == d for n, d in digests.items())
    except (OSError, ValueError):
        return False


def ensure_sources() -> Path:
    """The folder holding vLLM's extracted files, fetching the wheel the first time."""
    root = cache_dir()
    src = root / "src"
    if _extracted_ok(src):
        return src
    wheel = _find_wheel(root) or _download_wheel(root)
    _extract(wheel, root, src)
    if not _extracted_ok(src):
        raise AnchorUnavailable(f"extracting vLLM's files into {src} failed")
    return src


# ---------------------------------------------------------------------------------------
# Reading constants out of the wheel's files without importing them
# ---------------------------------------------------------------------------------------


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _assigned(body: list[ast.stmt], name: str) -> ast.expr | None:
    for node in body:
        if isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node.value
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == name
            and node.value is not None
        ):
            return node.value
    return None


def _module_constant(path: Path, name: str) -> Any:
    value = _assigned(_tree(path).body, name)
    if value is None:
        raise AnchorUnavailable(f"{name} not found in {path}")
    return ast.literal_eval(value)


def _hash_algos(path: Path) -> tuple[str, tuple[str, ...]]:
    """(CacheConfig.prefix_caching_hash_algo's default, the names PrefixCachingHashAlgo allows)."""
    tree = _tree(path)
    literal = _assigned(tree.body, "PrefixCachingHashAlgo")
    cls = next(
        (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheConfig"), None
    )
    default = _assigned(cls.body, "prefix_caching_hash_algo") if cls is not None else None
    if not isinstance(literal, ast.Subscript) or default is None:
        raise AnchorUnavailable(f"prefix_caching_hash_algo not found in {path}")
    names = ast.literal_eval(literal.slice)
    return ast.literal_eval(default), tuple(names if isinstance(names, tuple) else (names,))


def _compile_class(path: Path, name: str, module: str, namespace: dict[str, Any]) -> type:
    """Compile one class out of a vLLM file (whose other imports are not wanted)."""
    text = path.read_text()
    node = next(
        (n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == name), None
    )
    if node is None:
        raise AnchorUnavailable(f"class {name} not found in {path}")
    source = ast.get_source_segment(text, node)
    assert source is not None
    namespace = {"__name__": module, **namespace}
    exec(compile(source, str(path), "exec"), namespace)
    cls: type = namespace[name]
    return cls


# ---------------------------------------------------------------------------------------
# Loading the modules
# ---------------------------------------------------------------------------------------


class _Unused:
    """Stand-in for a vLLM class these paths never build; building one is a bug here."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{type(self).__name__} is a stub in benchmarks/_vllm_anchor.py")


def _unused_class(name: str) -> type:
    return type(name, (_Unused,), {})


def _unused_function(name: str) -> Callable[..., Any]:
    def stub(*args: object, **kwargs: object) -> Any:
        raise RuntimeError(f"{name} is a stub in benchmarks/_vllm_anchor.py")

    stub.__name__ = name
    return stub


class _Logger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """vllm.logger's logger: a logging.Logger plus the *_once methods vLLM calls."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})
        self._seen: set[tuple[str, str]] = set()

    def _once(self, level: int, msg: str, *args: object, **kwargs: object) -> None:
        if (str(level), msg) not in self._seen:
            self._seen.add((str(level), msg))
            self.log(level, msg, *args)

    def debug_once(self, msg: str, *args: object, **kwargs: object) -> None:
        self._once(logging.DEBUG, msg, *args)

    def info_once(self, msg: str, *args: object, **kwargs: object) -> None:
        self._once(logging.INFO, msg, *args)

    def warning_once(self, msg: str, *args: object, **kwargs: object) -> None:
        self._once(logging.WARNING, msg, *args)


def _stub_module(name: str, package: bool = False, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, "stub (benchmarks/_vllm_anchor.py)")
    if package:
        mod.__path__ = []  # no submodule is ever looked up on disk
    mod.__dict__.update(attrs)
    return mod


def _install(name: str, mod: types.ModuleType) -> None:
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)


def _exec_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AnchorUnavailable(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    _install(name, mod)
    spec.loader.exec_module(mod)
    return mod


_T = typing.TypeVar("_T")


def _stubs(src: Path, constant_list: type) -> dict[str, types.ModuleType]:
    """The stand-ins, in import order (parents first). See the module docstring."""
    medium_gpu = _module_constant(src / "vllm/distributed/kv_events.py", "MEDIUM_GPU")
    mods = [
        _stub_module("vllm", package=True),
        _stub_module("vllm.utils", package=True),
        _stub_module("vllm.v1", package=True),
        _stub_module("vllm.v1.core", package=True),
        _stub_module("vllm.distributed", package=True),
        _stub_module("vllm.multimodal", package=True),
        _stub_module("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False),
        _stub_module("vllm.logger", init_logger=_Logger),
        _stub_module("vllm.config", VllmConfig=_unused_class("VllmConfig")),
        _stub_module(
            "vllm.distributed.kv_events",
            MEDIUM_GPU=medium_gpu,
            **{
                n: _unused_class(n)
                for n in ("AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent")
            },
        ),
        _stub_module(
            "vllm.multimodal.utils",
            get_mm_features_in_window=_unused_function("get_mm_features_in_window"),
        ),
        _stub_module(
            "vllm.v1.core.kv_cache_metrics",
            KVCacheMetricsCollector=_unused_class("KVCacheMetricsCollector"),
        ),
        _stub_module(
            "vllm.v1.kv_cache_interface",
            iter_layer_specs=_unused_function("iter_layer_specs"),
            **{
                n: _unused_class(n)
                for n in (
                    "KVCacheConfig",
                    "KVCacheGroupSpec",
                    "KVCacheSpec",
                    "MambaSpec",
                    "UniformTypeKVCacheSpecs",
                )
            },
        ),
        _stub_module(
            "vllm.v1.kv_cache_spec_registry",
            KVCacheSpecRegistry=_unused_class("KVCacheSpecRegistry"),
        ),
        _stub_module("vllm.v1.request", Request=_unused_class("Request")),
        _stub_module(
            "vllm.v1.utils",
            ConstantList=constant_list,
            tensor_data=_unused_function("tensor_data"),
        ),
    ]
    return {m.__name__: m for m in mods}


@dataclass(frozen=True)
class _Vllm:
    """One loaded copy of vLLM's modules, with one hash algorithm initialised."""

    version: str
    src: Path
    hash_algo: str
    hash_fn: Callable[[Any], bytes]
    block_pool: types.ModuleType  # vllm.v1.core.block_pool
    kv_cache_utils: types.ModuleType  # vllm.v1.core.kv_cache_utils
    cdiv: Callable[[int, int], int]  # vllm.utils.math_utils.cdiv
    constant_list: type  # vllm.v1.utils.ConstantList


_LOADED: dict[str, _Vllm] = {}


def default_hash_algo() -> str:
    """vLLM's default prefix-caching hash algorithm (CacheConfig.prefix_caching_hash_algo)."""
    return _hash_algos(ensure_sources() / "vllm/config/cache.py")[0]


def _load(hash_algo: str | None) -> _Vllm:
    with _LOCK:
        src = ensure_sources()
        default, algos = _hash_algos(src / "vllm/config/cache.py")
        algo = hash_algo or default
        if algo not in algos:
            raise ValueError(f"hash_algo {algo!r}: vLLM {VLLM_VERSION} offers {algos}")
        if algo in _LOADED:
            return _LOADED[algo]
        version = _module_constant(src / "vllm/_version.py", "__version__")
        if version != VLLM_VERSION:
            raise AnchorUnavailable(f"{src} holds vLLM {version}, not {VLLM_VERSION}")
        needs_cbor2 = algo.endswith("_cbor")
        has_cbor2 = importlib.util.find_spec("cbor2") is not None
        if needs_cbor2 and not has_cbor2:
            raise AnchorUnavailable(
                f"the Python package cbor2 is not installed (vLLM's {algo} hash needs it)"
            )
        constant_list = _compile_class(
            src / "vllm/v1/utils.py",
            "ConstantList",
            "vllm.v1.utils",
            {"Generic": typing.Generic, "T": _T, "Sequence": Sequence, "overload": typing.overload},
        )

        def ours(name: str) -> bool:
            return name == "vllm" or name.startswith("vllm.") or (name == "cbor2" and not has_cbor2)

        saved = {name: sys.modules.pop(name) for name in list(sys.modules) if ours(name)}
        try:
            for name, mod in _stubs(src, constant_list).items():
                _install(name, mod)
            if not has_cbor2:
                sys.modules["cbor2"] = _stub_module(
                    "cbor2", dumps=_unused_function("cbor2.dumps (cbor2 is not installed)")
                )
            math_utils = _exec_file("vllm.utils.math_utils", src / "vllm/utils/math_utils.py")
            hashing = _exec_file("vllm.utils.hashing", src / "vllm/utils/hashing.py")
            kcu = _exec_file("vllm.v1.core.kv_cache_utils", src / "vllm/v1/core/kv_cache_utils.py")
            bp = _exec_file("vllm.v1.core.block_pool", src / "vllm/v1/core/block_pool.py")
        except AnchorUnavailable:
            raise
        except Exception as e:
            raise AnchorUnavailable(
                f"loading vLLM {VLLM_VERSION}'s block pool failed: {type(e).__name__}: {e}"
            ) from e
        finally:
            for name in list(sys.modules):
                if ours(name):
                    del sys.modules[name]
            sys.modules.update(saved)
        if algo.startswith("xxhash") and hashing._xxhash is None:
            raise AnchorUnavailable(
                f"the Python package xxhash (>= 3, with xxh3_128_digest) is not installed "
                f"(vLLM's {algo} hash needs it)"
            )
        hash_fn = hashing.get_hash_fn_by_name(algo)
        # EngineCore.__init__: init_none_hash(caching_hash_fn), once per process (here: once
        # per loaded copy, so two algorithms never share kv_cache_utils.NONE_HASH).
        kcu.init_none_hash(hash_fn)
        loaded = _Vllm(version, src, algo, hash_fn, bp, kcu, math_utils.cdiv, constant_list)
        _LOADED[algo] = loaded
        return loaded


# ---------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------


class _AnchorRequest:
    """The attributes of vllm.v1.request.Request that vLLM reads on these paths, set as
    Request.__init__ sets them (a plain class, like Request: attributes in __dict__)."""

    constant_list: type  # vLLM's ConstantList, set per loaded copy

    def __init__(
        self,
        prompt_token_ids: list[int],
        block_hasher: Callable[[_AnchorRequest], list[bytes]],
        cache_salt: str | None,
    ) -> None:
        self.lora_request = None
        self.prompt_token_ids = prompt_token_ids
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self._all_token_ids = self.prompt_token_ids.copy()
        self.cache_salt = cache_salt
        self.mm_features: list[Any] = []
        self.all_token_ids = self.constant_list(self._all_token_ids)
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Compute block hashes for any new full blocks and append them."""
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)


class VllmPool:
    """One vLLM BlockPool (prefix caching on, one full-attention KV cache group) and the
    per-request work vLLM's KV cache manager does around it.

    `fresh` and `cached` each take a prompt as a list of token ids and build the request
    (hashing its full blocks, as vLLM does when a request arrives) inside the call.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, hash_algo: str | None = None):
        """`hash_algo`: one of vLLM's prefix_caching_hash_algo names; None is vLLM's default."""
        v = _load(hash_algo)
        self._v = v
        self.hash_algo = v.hash_algo
        self.block_size = block_size
        self.kv_cache_group_id = 0
        # KVCacheCoordinator.__init__ (one group: hash_block_size == block_size; events and
        # metrics off, no lookahead tokens without speculative decoding).
        self.block_pool = v.block_pool.BlockPool(
            num_gpu_blocks=num_blocks,
            enable_caching=True,
            hash_block_size=block_size,
            enable_kv_cache_events=False,
            metrics_collector=None,
            num_hash_lookahead_tokens=0,
        )
        # EngineCore.__init__: get_request_block_hasher(hash_block_size, caching_hash_fn, 0).
        self._block_hasher = v.kv_cache_utils.get_request_block_hasher(block_size, v.hash_fn, 0)
        self._request_cls = type("Request", (_AnchorRequest,), {"constant_list": v.constant_list})
        self._trim_null_head = v.kv_cache_utils.trim_null_head
        self._resolve_block_hashes = v.kv_cache_utils.resolve_block_hashes
        self._cdiv = v.cdiv

    def describe(self) -> str:
        return f"vLLM {self._v.version} BlockPool, hash {self.hash_algo}, loaded from {self._v.src}"

    def num_free_blocks(self) -> int:
        return int(self.block_pool.get_num_free_blocks())

    def _request(self, tokens: list[int], cache_salt: str | None) -> _AnchorRequest:
        # Request.__init__ runs the block hasher over the prompt's full blocks.
        return self._request_cls(tokens, self._block_hasher, cache_salt)

    def fresh(self, tokens: list[int], cache_salt: str | None = None) -> None:
        """A request whose prompt is not cached: hash, allocate, cache the full blocks, free.

        Allocation pops the free queue's head, evicting cached blocks from the prefix cache
        when it reaches them (BlockPool.get_new_blocks), so this works with a pool smaller
        than the prompts sent through it. A prompt needing more blocks than are free raises
        vLLM's ValueError.
        """
        pool = self.block_pool
        block_size = self.block_size
        request = self._request(tokens, cache_salt)
        num_tokens = request.num_tokens
        # SingleTypeKVCacheManager.allocate_new_blocks
        req_blocks: list[Any] = []
        num_new_blocks = self._cdiv(num_tokens, block_size) - len(req_blocks)
        if num_new_blocks > 0:
            req_blocks.extend(pool.get_new_blocks(num_new_blocks))
        # SingleTypeKVCacheManager.cache_blocks (full attention: block_mask None)
        num_cached_blocks = 0
        num_hashed_tokens = len(request.block_hashes) * pool.hash_block_size
        num_full_blocks = min(num_tokens, num_hashed_tokens) // block_size
        if num_cached_blocks < num_full_blocks:
            pool.cache_full_blocks(
                request=request,
                blocks=req_blocks,
                num_cached_blocks=num_cached_blocks,
                num_full_blocks=num_full_blocks,
                block_size=block_size,
                kv_cache_group_id=self.kv_cache_group_id,
                block_mask=None,
            )
        # SingleTypeKVCacheManager.free: tail blocks first
        pool.free_blocks(reversed(self._trim_null_head(req_blocks)))

    def cached(
        self,
        tokens: list[int],
        max_hit_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """A request's prefix-cache hit: hash, find the longest cached prefix, hold (touch)
        those blocks, free them. Returns the number of hit blocks.

        `max_hit_tokens` None is what vLLM's scheduler passes (KVCacheManager
        .get_computed_blocks: ``request.num_tokens - 1``, so the last token is recomputed):
        a prompt of 64 full blocks plus one token hits 64 blocks, one of exactly 64 blocks
        hits 63.
        """
        pool = self.block_pool
        request = self._request(tokens, cache_salt)
        if max_hit_tokens is None:
            max_hit_tokens = request.num_tokens - 1
        hit_blocks = self._find_longest_cache_hit(request.block_hashes, max_hit_tokens)[0][0]
        # SingleTypeKVCacheManager.add_local_computed_blocks: touch, then hold
        req_blocks: list[Any] = []
        pool.touch(hit_blocks)
        req_blocks.extend(hit_blocks)
        # SingleTypeKVCacheManager.free
        pool.free_blocks(reversed(self._trim_null_head(req_blocks)))
        return len(hit_blocks)

    def request(self, tokens: list[int], cache_salt: str | None = None) -> int:
        """A request's whole prefill as the scheduler runs it: hash, find the longest
        cached prefix, hold (touch) it, allocate the rest, cache the full blocks, free.
        Returns the number of hit blocks."""
        pool = self.block_pool
        block_size = self.block_size
        request = self._request(tokens, cache_salt)
        num_tokens = request.num_tokens
        hit_blocks = self._find_longest_cache_hit(request.block_hashes, num_tokens - 1)[0][0]
        # SingleTypeKVCacheManager.add_local_computed_blocks + allocate_new_blocks
        pool.touch(hit_blocks)
        req_blocks: list[Any] = list(hit_blocks)
        num_new_blocks = self._cdiv(num_tokens, block_size) - len(req_blocks)
        if num_new_blocks > 0:
            req_blocks.extend(pool.get_new_blocks(num_new_blocks))
        # SingleTypeKVCacheManager.cache_blocks
        num_cached_blocks = len(hit_blocks)
        num_hashed_tokens = len(request.block_hashes) * pool.hash_block_size
        num_full_blocks = min(num_tokens, num_hashed_tokens) // block_size
        if num_cached_blocks < num_full_blocks:
            pool.cache_full_blocks(
                request=request,
                blocks=req_blocks,
                num_cached_blocks=num_cached_blocks,
                num_full_blocks=num_full_blocks,
                block_size=block_size,
                kv_cache_group_id=self.kv_cache_group_id,
                block_mask=None,
            )
        pool.free_blocks(reversed(self._trim_null_head(req_blocks)))
        return len(hit_blocks)

    def _find_longest_cache_hit(
        self, block_hashes: list[bytes], max_length: int
    ) -> tuple[tuple[list[Any], ...], int]:
        """FullAttentionManager.find_longest_cache_hit as UnitaryKVCacheCoordinator calls it:
        one group, alignment_tokens = block_size (not fine-grained), no EAGLE, no DCP."""
        block_pool = self.block_pool
        block_size = self.block_size
        alignment_tokens = block_size
        kv_cache_group_ids = [self.kv_cache_group_id]
        block_hashes = self._resolve_block_hashes(
            block_hashes,
            block_pool.hash_block_size,
            block_size,
            supports_fine_grained_hash_lookup=True,
            alignment_tokens=alignment_tokens,
        )
        computed_blocks: tuple[list[Any], ...] = tuple([] for _ in range(len(kv_cache_group_ids)))
        for block_hash in itertools.islice(block_hashes, max_length // block_size):
            cached_block = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if not cached_block:
                break
            for computed, cached in zip(computed_blocks, cached_block, strict=False):
                computed.append(cached)
        hit_length = len(computed_blocks[0]) * block_size
        hit_length -= hit_length % alignment_tokens
        num_blocks = self._cdiv(hit_length, block_size)
        for computed in computed_blocks:
            del computed[num_blocks:]
        return computed_blocks, hit_length


def describe(hash_algo: str | None = None) -> str:
    """One line naming what the anchor runs, e.g. for a benchmark's header."""
    v = _load(hash_algo)
    return f"vLLM {v.version} BlockPool, hash {v.hash_algo}, loaded from {v.src}"


# ---------------------------------------------------------------------------------------
# Self-check
# ---------------------------------------------------------------------------------------


def _median_us(fn: Callable[[int], object], iterations: int) -> float:
    import statistics
    import time

    samples = []
    for i in range(iterations):
        t0 = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _main() -> int:
    b = 16
    try:
        pool = VllmPool(2_000, b)
    except AnchorUnavailable as e:
        print(f"skipped: {e.reason}")
        return 0
    print(pool.describe())
    iterations = 300
    vllm_loaded = any(n == "vllm" or n.startswith("vllm.") for n in sys.modules)
    assert not vllm_loaded, "vllm.* left in sys.modules"

    # (1) fresh, 1,000-block prompt: a new salt each call, so every block is hashed anew
    # and, from the second call on, allocation evicts the previous call's cached blocks.
    big = list(range(1_000 * b))
    us = _median_us(lambda i: pool.fresh(big, cache_salt=f"big-{i}"), iterations)
    assert pool.cached([*big, 0], cache_salt=f"big-{iterations - 1}") == 1_000
    print(f"fresh  1,000-block prompt (hash + alloc + cache + free): {us / 1e3:8.3f} ms")

    # (2) fresh, 64-block prompt (64 full blocks + 1 token, as the scheduler sees a prompt).
    p64 = list(range(64 * b + 1))
    us = _median_us(lambda i: pool.fresh(p64, cache_salt=f"p64-{i}"), iterations)
    print(f"fresh     64-block prompt (hash + alloc + cache + free): {us:8.1f} us")

    # (3) cached: the same 64-block prompt, once through fresh, then hit.
    pool.fresh(p64)
    assert pool.cached(p64) == 64
    assert pool.cached(p64[: 64 * b]) == 63  # vLLM recomputes the last token
    hits: list[int] = []
    us = _median_us(lambda i: hits.append(pool.cached(p64)), iterations)
    assert hits == [64] * iterations
    print(f"cached    64-block prompt (hash + lookup + touch + free): {us:8.1f} us")
    assert pool.num_free_blocks() == 2_000 - 1  # all but the null block
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
