"""`kvfold bench-serve`: real engines behind each router, driven by a trace's requests, and
the engines' own counters and the client's clock side by side (docs/serving.md).

    kvfold.bench.bench_trace   a trace's requests as prompts an engine serves
    kvfold.bench.bench_serve   one arm's run, its rows and the table
    kvfold.bench.serve_runner  every arm on one cluster and one engine fleet
"""
