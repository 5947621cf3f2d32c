"""Triton kernels over the ragged layout (docs/architecture.md, "Attention implementations").

One launch per layer for the whole batch; every kernel has a torch oracle in the tests
(`attention_backend/torch_ref.py`, the storage's torch row writer `RaggedStorage.write_sealed`). The kernel modules import
Triton; `aot.py` does not, and the torch-only CPU path imports none of them. Nothing here
imports attention_backend/ (tests/unit/test_import_graph.py).
"""
