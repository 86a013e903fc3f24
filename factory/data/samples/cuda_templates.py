"""CUDA and PyTorch source templates for the ``cuda_kernel`` family (``string.Template``, ``$name``)."""

from __future__ import annotations

__all__ = ["BINARY", "KERNELS", "REFERENCE", "UNARY"]

# op -> (CUDA expression of v, PyTorch expression of x)
UNARY: dict[str, tuple[str, str]] = {
    "relu": ("fmaxf(v, 0.0f)", "torch.relu(x)"),
    "sigmoid": ("1.0f / (1.0f + expf(-v))", "torch.sigmoid(x)"),
    "silu": ("v / (1.0f + expf(-v))", "torch.nn.functional.silu(x)"),
    "gelu_tanh": (
        "0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)))",
        'torch.nn.functional.gelu(x, approximate="tanh")',
    ),
    "leaky_relu": (
        "v > 0.0f ? v : $alpha * v",
        "torch.nn.functional.leaky_relu(x, negative_slope=$alpha)",
    ),
    "hardtanh": ("fminf(fmaxf(v, -1.0f), 1.0f)", "torch.clamp(x, -1.0, 1.0)"),
    "softplus": ("v > 20.0f ? v : log1pf(expf(v))", "torch.nn.functional.softplus(x)"),
}
# op -> (CUDA expression of a, b; PyTorch expression of a, b)
BINARY: dict[str, tuple[str, str]] = {
    "add": ("a + b", "a + b"),
    "mul": ("a * b", "a * b"),
    "scaled_add": ("a + $alpha * b", "a + $alpha * b"),
    "squared_diff": ("(a - b) * (a - b)", "(a - b) ** 2"),
}

REFERENCE = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """$doc"""

    def __init__(self) -> None:
        super().__init__()

    def forward($args) -> torch.Tensor:
        return $expr


def get_inputs() -> list[torch.Tensor]:
    return [$inputs]
'''

_HEADER = "#include <torch/extension.h>\n#include <cuda_runtime.h>\n\n"
_CHECK = (
    '    TORCH_CHECK($t.is_cuda() && $t.is_contiguous(), "$t must be a contiguous CUDA tensor");\n'
)

KERNELS: dict[str, str] = {
    "unary": _HEADER
    + """__global__ void ${op}_kernel(const float* __restrict__ x, float* __restrict__ out, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    $guard{
        float v = x[i];
        out[i] = $cuda;
    }
}

torch::Tensor ${op}_cuda(torch::Tensor x) {
"""
    + _CHECK.replace("$t", "x")
    + """    auto out = torch::empty_like(x);
    int64_t n = x.numel();
    int threads = $threads;
    int64_t blocks = (n + threads - 1) / threads;
    ${op}_kernel<<<blocks, threads>>>(x.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
""",
    "binary": _HEADER
    + """__global__ void ${op}_kernel(const float* __restrict__ pa, const float* __restrict__ pb,
                          float* __restrict__ out, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; $guard; i += (int64_t)gridDim.x * blockDim.x) {
        float a = pa[i], b = pb[i];
        out[i] = $cuda;
    }
}

torch::Tensor ${op}_cuda(torch::Tensor a, torch::Tensor b) {
"""
    + _CHECK.replace("$t", "a")
    + _CHECK.replace("$t", "b")
    + """    auto out = torch::empty_like(a);
    int64_t n = a.numel();
    int threads = $threads;
    int blocks = (int)std::min<int64_t>((n + threads - 1) / threads, 65535);
    ${op}_kernel<<<blocks, threads>>>(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
""",
    "row_softmax": _HEADER
    + """// One block per row; shared memory holds the partial max, then the partial sum.
__global__ void row_softmax_kernel(const float* __restrict__ x, float* __restrict__ out, int cols) {
    extern __shared__ float buf[];
    const float* row = x + (int64_t)blockIdx.x * cols;
    float* dst = out + (int64_t)blockIdx.x * cols;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, row[j]);
    buf[threadIdx.x] = m;
    $sync
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    m = buf[0];
    __syncthreads();
    float sum = 0.0f;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) sum += expf(row[j] - m);
    buf[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    float inv = 1.0f / buf[0];
    for (int j = threadIdx.x; j < cols; j += blockDim.x) dst[j] = expf(row[j] - m) * inv;
}

torch::Tensor row_softmax_cuda(torch::Tensor x) {
"""
    + _CHECK.replace("$t", "x")
    + """    auto out = torch::empty_like(x);
    int rows = x.size(0), cols = x.size(1), threads = $threads;
    row_softmax_kernel<<<rows, threads, threads * sizeof(float)>>>(x.data_ptr<float>(), out.data_ptr<float>(), cols);
    return out;
}
""",
    "matmul": _HEADER
    + """#define TILE $tile

// C = A @ B with square shared-memory tiles; each thread computes one element of C.
__global__ void matmul_kernel(const float* A, const float* B, float* C, int M, int N, int K) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < (K + TILE - 1) / TILE; ++t) {
        int ka = t * TILE + threadIdx.x, kb = t * TILE + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < M && ka < K) ? A[row * K + ka] : 0.0f;
        Bs[threadIdx.y][threadIdx.x] = (kb < K && col < N) ? B[kb * N + col] : 0.0f;
        $sync
        for (int k = 0; k < TILE; ++k) acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) C[row * N + col] = acc;
}

torch::Tensor matmul_cuda(torch::Tensor a, torch::Tensor b) {
"""
    + _CHECK.replace("$t", "a")
    + _CHECK.replace("$t", "b")
    + """    int M = a.size(0), K = a.size(1), N = b.size(1);
    auto c = torch::empty({M, N}, a.options());
    dim3 threads(TILE, TILE), blocks((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    matmul_kernel<<<blocks, threads>>>(a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), M, N, K);
    return c;
}
""",
}
