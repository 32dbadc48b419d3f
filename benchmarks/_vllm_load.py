"""Load vLLM 0.33.0's own block pool and request hashing from the files
benchmarks/_vllm_fetch.py extracted, without vLLM installed (benchmarks/_vllm_anchor.py
runs them).

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
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _vllm_fetch import _LOCK, VLLM_VERSION, AnchorUnavailable, ensure_sources

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
        except Exception as e:  # foreign code at import: whatever it raises, the anchor is out
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
