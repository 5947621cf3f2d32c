"""Compatibility layers between SGLang 0.5.23 and the machines it runs on here (sgl_kernel_cpu,
import_hook, cpu_tp, cpu_gemm, cpu_ops, cpu_triton, cpu_lora, cpu_start, dual_gemm), and
shared_tokenizer, which spares a scheduler a second load of its tokenizer."""
