# Benchmarks of the live service (how to run: docs/benchmarks.md; the runs so far:
# docs/history/benchmarks-notebook.md, section "Live service").
# Each target starts what it needs (a private redis-server, orcapod up) on 127.0.0.1
# and stops it again; results land in bench/results/.
PYTHON ?= .venv/bin/python

.PHONY: bench bench-quick bench-compare bench-capacity soak soak-quick

bench: bench-compare bench-capacity

bench-compare:
	$(PYTHON) -m orcapod bench compare --no-progress

bench-capacity:
	$(PYTHON) -m orcapod bench capacity

bench-quick:
	$(PYTHON) -m orcapod bench compare --quick --no-progress --out bench/results/compare-quick

# 1,000 clients on one gateway, then a 300 s soak sampling RSS and fds
# (docs/history/benchmarks-notebook.md, "Soak").
soak:
	$(PYTHON) -m bench.soak

soak-quick:
	$(PYTHON) -m bench.soak --duration-s 20 --clients 100 --out bench/results/soak-quick
