"""On the CPU, `load(cpu_float32=True)` computes in float32 where the upcast costs little memory: small models, and
quantized models of any size (only their scales, biases and other floating-point arrays double; the codes stay
uint32), not large unquantized ones. (MLX's CPU quantized matmuls run ~10x faster on float32 than on bf16.)"""

import mlx.core as mx
import mlx.nn as nn
import pytest

from rq_core import checkpoint
from rq_core.checkpoint import cpu_float32_pays, load


class _Two(nn.Module):
    def __init__(self, quantized: bool) -> None:
        super().__init__()
        self.a = nn.Linear(512, 512, bias=False)
        self.b = nn.Linear(512, 512, bias=False)
        self.set_dtype(mx.bfloat16)
        if quantized:
            nn.quantize(self, group_size=64, bits=2)


def _bytes(m) -> tuple[int, int]:
    from mlx.utils import tree_flatten

    vs = [v for _, v in tree_flatten(m.parameters())]
    return sum(v.nbytes for v in vs), sum(v.nbytes for v in vs if mx.issubdtype(v.dtype, mx.floating))


def test_quantized_model_past_the_byte_cap_is_upcast(monkeypatch):
    m = _Two(quantized=True)
    total, floats = _bytes(m)
    assert floats < 0.25 * total  # 2 bits, group 64: codes 16 B and bf16 scale+bias 4 B a group
    monkeypatch.setattr(checkpoint, "CPU_FLOAT32_MAX_BYTES", total // 2)  # the old rule (total bytes): no upcast
    assert cpu_float32_pays(m)


def test_unquantized_model_past_the_byte_cap_keeps_its_dtype(monkeypatch):
    m = _Two(quantized=False)
    total, floats = _bytes(m)
    monkeypatch.setattr(checkpoint, "CPU_FLOAT32_MAX_BYTES", total // 2)
    assert not cpu_float32_pays(m)  # doubling it would add `total` bytes
    monkeypatch.setattr(checkpoint, "CPU_FLOAT32_MAX_BYTES", total)
    assert cpu_float32_pays(m)  # small enough: as before


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU rule")
def test_bundled_model_loads_in_float32_even_past_the_byte_cap(monkeypatch):
    from rq_core.paging.pager import activation_dtype

    monkeypatch.setattr(checkpoint, "CPU_FLOAT32_MAX_BYTES", 1)
    ck = load(None, tokenizer=False, cpu_float32=True)
    assert activation_dtype(ck.model) == mx.float32
    assert activation_dtype(load(None, tokenizer=False).model) != mx.float32  # cpu_float32=False: as stored
