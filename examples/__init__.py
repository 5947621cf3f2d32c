"""SGLang frontend-language programs to run against a ragged server (docs/benchmarks.md)."""
