"""deep_ep.utils.math for moed's DeepEP on CPU: the helpers DeepEP's tests import, with DeepEP's
meanings. FP8 tensors are torch.float8_e4m3fn where torch has it, else torch.uint8 holding
E4M3FN bits (moed.fp8_dtype); the casts are exact (round to nearest even, as torch's)."""
from typing import Tuple

import torch

import moed

_FP8 = moed.fp8_dtype


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity distance: 1 - 2 <x+1, y+1> / (|x+1|^2 + |y+1|^2), in float64."""
    a, b = x.double() + 1, y.double() + 1
    return (1 - 2 * (a * b).sum() / (a * a + b * b).sum()).item()


def safe_div(a, b) -> float:
    """a / b, and 0 for 0 / 0 (any other division by zero still raises)."""
    if b == 0 and a == 0:
        return 0
    return a / b


def ceil_div(x: int, y: int) -> int:
    return -(-x // y)


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


def _e4m3_table() -> torch.Tensor:
    """The float value of each of the 256 E4M3FN bit patterns (0x7f / 0xff are NaN)."""
    v = torch.arange(256, dtype=torch.int64)
    sign = torch.where(v >= 128, -1.0, 1.0).double()
    exp, man = (v >> 3) & 0xF, v & 0x7
    normal = (1 + man.double() / 8) * torch.pow(2.0, (exp - 7).double())
    sub = man.double() / 8 * 2.0 ** -6
    value = sign * torch.where(exp == 0, sub, normal)
    value[(v & 0x7F) == 0x7F] = float("nan")
    return value.float()


_E4M3 = _e4m3_table()


def _fp8_bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3FN bits, nearest even, |v| > 448 saturating (moed's cast, which for the
    values these helpers make, |v| <= 448, is torch's .to(torch.float8_e4m3fn))."""
    bits = moed._C._to_fp8(v.contiguous().float())
    return bits if _FP8 is torch.uint8 else bits.view(_FP8)


def per_token_cast_to_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per 128 channels of a row: amax = max(|x|, 1e-4), data = x * (448 / amax) in FP8 and
    scales = amax / 448 (float32, [m, ceil(n / 128)]); n is padded with zeros to a multiple
    of 128 for the blocks, and the data cut back to n columns."""
    assert x.dim() == 2
    m, n = x.shape
    padded = torch.nn.functional.pad(x, (0, align(n, 128) - n)).view(m, -1, 128)
    amax = padded.abs().float().amax(dim=2).clamp(min=1e-4)
    data = _to_e4m3((padded.float() * (448.0 / amax).unsqueeze(2)).view(m, -1))[:, :n].contiguous()
    return data, amax / 448.0


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """FP8 data and its per-128-channel scales (float32, or UE8M0 exponents packed four to an
    int32) back to bfloat16."""
    if x_fp8.numel() == 0:
        return torch.zeros(x_fp8.shape, dtype=torch.bfloat16)
    assert x_fp8.dim() == 2
    m, n = x_fp8.shape
    values = _E4M3[_fp8_bits(x_fp8).long()]
    values = torch.nn.functional.pad(values, (0, align(n, 128) - n)).view(m, -1, 128)
    if x_scales.dtype == torch.int32:
        exponents = x_scales.contiguous().view(torch.uint8).to(torch.int32)
        x_scales = (exponents << 23).view(torch.float32)
    scaled = values * x_scales.reshape(m, -1, 1).float()
    return scaled.view(m, -1)[:, :n].to(torch.bfloat16).contiguous()


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Each row of x (values in [-1, num_slots)) becomes its distinct values >= 0, descending,
    then -1s; at most min(num_slots, columns) values are kept."""
    assert x.dim() == 2
    present = torch.zeros((x.size(0), num_slots + 1), dtype=torch.bool)
    present.scatter_(1, x.masked_fill(x < 0, num_slots).long(), True)
    present = present[:, :num_slots]
    slots = torch.arange(num_slots - 1, -1, -1, dtype=x.dtype).expand(x.size(0), num_slots)
    ranked = torch.where(present.flip(1), slots, torch.full_like(slots, -1))
    ranked = ranked.sort(dim=1, descending=True).values
    x.fill_(-1)
    k = min(num_slots, x.size(1))
    x[:, :k] = ranked[:, :k]


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """scores [T, E] with the experts outside each token's chosen groups set to 0."""
    num_tokens, num_experts = scores.shape
    keep = torch.zeros((num_tokens, num_groups), dtype=torch.bool)
    keep.scatter_(1, group_idx, True)
    mask = keep.repeat_interleave(num_experts // num_groups, dim=1)
    return scores * mask


def hash_tensor(t: torch.Tensor) -> int:
    """The sum of t's bytes read as int32 words (DeepEP's cheap checksum)."""
    return t.contiguous().view(torch.int).sum().item()


def hash_tensors(*tensors) -> int:
    value = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            value ^= hash_tensors(*t)
        elif isinstance(t, torch.Tensor):
            value ^= hash_tensor(t)
    return value


def count_bytes(*tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total
