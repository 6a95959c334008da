"""The local tools: what runs the operator's decisions on one machine instead of a cluster. `specserve canary` and
`specserve demo` on real runtimes, `specserve simulate` on a simulated fleet, `specserve bench-operator` against
KMock. The controller's modules never import them (an import-linter contract, tests/test_imports.py)."""
