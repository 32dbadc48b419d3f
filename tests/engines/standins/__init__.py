"""Stand-in processes that speak an engine's wire (SGLang's ZMQ publisher, trtllm-serve's
HTTP endpoints), and `StandInProcess`, how a test runs one."""
