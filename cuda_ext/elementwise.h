// A decoder layer's RMSNorm and rotary embedding on the CPU (elementwise.cpp), in one call each
// where SGLang's torch form (`forward_native`) runs a dozen small torch ops; and the Hadamard
// rotation of rotated rows (--ragged-rotation hadamard), where the dense form runs five.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace ragged {

// SGLang's RMSNorm.forward_native: s = x (+ residual), in float32; out = dtype(s / sqrt(mean(s^2)
// + eps) * weight). x [..., H] and residual alike (float32, bfloat16 or float16, contiguous),
// weight [H] (any of the three). Returns {out} or, with a residual, {out, dtype(s)}.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                 const at::Tensor& weight, double eps);

// SGLang's RotaryEmbedding.forward_native (utils.apply_rotary_emb): the first rotary_dim channels
// of every head of query and key rotated by the cos/sin of its token's position, each product,
// difference and sum rounded to the tensors' dtype as torch's ops do; the rest copied. positions
// [T] int64; query [T, Hq * head_size] or [T, Hq, head_size] and key alike (their rows may be
// strided, channels contiguous); cos_sin_cache [max_position, rotary_dim] (cos half, sin half).
// Returns new contiguous {query, key} of the inputs' shapes.
std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                         const at::Tensor& key, const at::Tensor& cos_sin_cache,
                                         int64_t head_size, bool neox);

// Every head of x [T, heads, D] (float32, bfloat16 or float16; a token's heads contiguous, its
// rows may be strided) times its KV head's randomized Hadamard matrix R = diag(s) H / sqrt(D)
// (rotation.py; `signs` [kv_heads, D] float32 +-1, head h's KV head h / (heads / kv_heads)), or
// times R^T with `inverse`: rotation.py's fwht in float32, rounded once to x's dtype. A new
// contiguous [T, heads, D]. The server's rotated rows (HeadRotations) on the CPU.
at::Tensor hadamard_heads(const at::Tensor& x, const at::Tensor& signs, bool inverse);

}  // namespace ragged
