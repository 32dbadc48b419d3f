"""Real engines as ranks (DESIGN §10): what vLLM, SGLang and TensorRT-LLM publish, read
without importing them, and turned into kvfold's rank reports and block events.

    vllm_wire     vLLM's ZMQ KV-event frames and its replay protocol, strictly decoded
    vllm_metrics  vLLM's /metrics page: the numbers of a rank it publishes
    content_keys  an engine's blocks keyed by kvfold's own prefix keys (never its hashes)
    engine_source one engine's event stream: order, gaps, replay, restarts, the live set
    vllm_settings, vllm_server      a trial vLLM OpenAI server: its checked settings, the
                                    process (tests, benchmarks, a user's trial)
    sglang_wire, sglang_metrics     SGLang's KV events (vLLM's design) and /metrics (tokens)
    trtllm_decode, trtllm_events    TensorRT-LLM's KV cache events: decoded (JSON), translated
    trtllm_stats  TensorRT-LLM's iteration stats (kvCacheStats)
    endpoints     where an engine rank reads its engine (checked: loopback binds only)
    engine_numbers  a numbers page in kvfold's units (blocks), and what it cannot give
    kinds         what differs per engine kind: its decoders and its numbers page
    engine_intake one engine rank's incoming events, shared by its reader threads
    engine_readers  the threads that read them: ZMQ (vLLM, SGLang), HTTP polls (TRT-LLM)

Pure cores and the reader threads; the Ray shell (engine_rank_actor) stands above them.
"""
