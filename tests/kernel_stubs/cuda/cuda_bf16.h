// Stub of cuda_bf16.h for a host C++ compiler's syntax check only (tests/test_kernels.py).
#pragma once
struct __nv_bfloat16 { unsigned short v; };
float __bfloat162float(__nv_bfloat16);
__nv_bfloat16 __float2bfloat16_rn(float);
