"""Request guard: refuses, before the scheduler, requests that would crash it (issue 12)."""
