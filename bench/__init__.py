"""The benchmarks, each run from the repo root as ``python -m bench.<name>`` (how to run
each and what it feeds: docs/benchmarks.md): ``llama_cpp``, ``quant_agreement``,
``cpu_kernels`` (``cpu_kernels_numba`` is one of its candidates), ``lm_head``, ``orca_peer``,
``multiturn``, ``control_plane``, ``scheduler``, ``start_time``, ``engine``,
``profile_engine``, ``soak``, ``openai_load``, ``tokenizer_fairness``, ``gpu`` (run by
``bench/gpu.sh``; ``bench/gpu_bundle.sh`` and ``bench/gpu_offline.sh`` take it to an
offline machine) and ``random_checkpoint``; and what they share, once: ``machine`` (what
ran a benchmark, for its JSON), ``output`` (the results folder, JSON files, progress
lines), ``timing`` (medians after a warm-up, runs taking turns), ``engine_plans`` (the
plans a benchmark hands ``Engine.step`` directly), ``child_process`` (a benchmark run
again as a child, ``python -m bench.<name>``), ``llama_cpp_build`` (llama.cpp built once,
its binaries and GGUF files) and ``llama_server`` (llama.cpp's server, started for a run).
None of them is run by the test suite; ``tests/bench`` tests their pure parts.
"""
