"""The request traces the tests replay, cut small and shipped in tests/fixtures/traces
(their source and licence in its README)."""

from pathlib import Path

TRACES = Path(__file__).resolve().parent / "fixtures" / "traces"
MOONCAKE = TRACES / "mooncake_synthetic_first500.jsonl"  # Mooncake's synthetic trace, 500 requests
AZURE_CODE = TRACES / "azure_code_first500.csv"  # Azure's 2023 code trace, 500 requests
