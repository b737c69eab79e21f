"""The subset of torch.distributed that DeepEP-style code and its tests call, on CPU tensors,
over moed's worlds. group is a moed.Group or a torch.distributed ProcessGroup (whose moed world
moed.from_torch makes); None is the calling rank's group (moed.current_group()).

Deterministic: all_reduce sums in ascending rank order (fp32 for floating types)."""
import torch

from ._world import as_group, current_group, shutdown


class ReduceOp:
    SUM = "sum"


class _Work:
    """What async_op=True returns: moed's collectives are complete on return."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _g(group):
    return as_group(group)


def _done(async_op):
    return _Work() if async_op else None


def is_initialized():
    try:
        current_group()
        return True
    except RuntimeError:
        return False


def get_rank(group=None):
    return _g(group).rank()


def get_world_size(group=None):
    return _g(group).size()


def barrier(group=None, async_op=False):
    _g(group).barrier()
    return _done(async_op)


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.device.type != "cpu":
        return f"{name} must be a CPU tensor, got device {t.device}"
    return ""


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output_tensor: world size x input_tensor's elements, rank order (dim 0 concatenated)."""
    g = _g(group)
    g.agree(_check_tensor("output_tensor", output_tensor) or _check_tensor("input_tensor", input_tensor)
            or ("" if output_tensor.dtype == input_tensor.dtype else
                f"output_tensor has dtype {output_tensor.dtype}, input_tensor {input_tensor.dtype}"))
    out = output_tensor if output_tensor.is_contiguous() else torch.empty_like(output_tensor).contiguous()
    g.handle.all_gather_into(out, input_tensor.contiguous())
    if out is not output_tensor:
        output_tensor.copy_(out)
    return _done(async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    g = _g(group)
    R = g.size()
    err = _check_tensor("tensor", tensor)
    if not err and len(tensor_list) != R:
        err = f"tensor_list has {len(tensor_list)} tensors; world size is {R}"
    for i, t in enumerate(tensor_list):
        if not err and (t.shape != tensor.shape or t.dtype != tensor.dtype):
            err = (f"tensor_list[{i}] is {t.dtype} {list(t.shape)}; tensor is "
                   f"{tensor.dtype} {list(tensor.shape)}")
    g.agree(err)
    out = torch.empty((R,) + tuple(tensor.shape), dtype=tensor.dtype)
    g.handle.all_gather_into(out, tensor.contiguous())
    for i, t in enumerate(tensor_list):
        t.copy_(out[i])
    return _done(async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Sum in place, in ascending rank order (fp32 accumulation for floating dtypes)."""
    g = _g(group)
    err = _check_tensor("tensor", tensor)
    if not err and op not in (ReduceOp.SUM, "sum", getattr(getattr(torch.distributed, "ReduceOp", None), "SUM", None)):
        err = f"op = {op} is not supported (only SUM)"
    g.agree(err)
    if tensor.dtype == torch.float32:
        t = tensor if tensor.is_contiguous() else tensor.contiguous()
        g.handle.all_reduce_f32(t)
        if t is not tensor:
            tensor.copy_(t)
        return _done(async_op)
    R = g.size()
    parts = torch.empty((R,) + tuple(tensor.shape), dtype=tensor.dtype)
    g.handle.all_gather_into(parts, tensor.contiguous())
    acc_type = torch.float32 if tensor.is_floating_point() else (torch.bool if tensor.dtype == torch.bool else torch.int64)
    if acc_type == torch.bool:
        tensor.copy_(parts.any(dim=0))
        return _done(async_op)
    acc = torch.zeros(tensor.shape, dtype=acc_type)
    for r in range(R):
        acc += parts[r].to(acc_type)
    tensor.copy_(acc)
    return _done(async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op=False):
    """torch.distributed.all_to_all_single on CPU tensors of any dtype (bfloat16 included, which
    Debian's torch 1.13 gloo rejects): input_split_sizes[r] rows (dim 0) of input, in rank order,
    go to rank r; output_split_sizes[r] rows from rank r land in output, in rank order. None
    splits dim 0 evenly. Sizes that do not match what a peer sends are every rank's error."""
    g = _g(group)
    R = g.size()
    err = _check_tensor("output", output) or _check_tensor("input", input)
    if not err and output.dtype != input.dtype:
        err = f"output has dtype {output.dtype}, input {input.dtype}"

    def split_bytes(t, sizes, name):
        rows = t.shape[0] if t.dim() > 0 else t.numel()
        row = t.numel() // rows * t.element_size() if rows else 0
        if sizes is None:
            if rows % R:
                raise ValueError(f"{name} has {rows} rows, which do not split evenly over {R} ranks")
            sizes = [rows // R] * R
        sizes = [int(n) for n in sizes]
        if len(sizes) != R or sum(sizes) != rows or min(sizes) < 0:
            raise ValueError(f"{name}_split_sizes = {sizes} do not split {name}'s {rows} rows over {R} ranks")
        return [n * row for n in sizes]

    out_bytes = in_bytes = None
    if not err:
        try:
            out_bytes = split_bytes(output, output_split_sizes, "output")
            in_bytes = split_bytes(input, input_split_sizes, "input")
        except ValueError as e:
            err = str(e)
    g.agree(err)
    out = output if output.is_contiguous() else torch.empty_like(output).contiguous()
    g.handle.all_to_all_into(out, input.contiguous(), out_bytes, in_bytes)
    if out is not output:
        output.copy_(out)
    return _done(async_op)


def broadcast(tensor, src, group=None, async_op=False):
    g = _g(group)
    err = _check_tensor("tensor", tensor)
    if not err and not 0 <= int(src) < g.size():
        err = f"src = {src} is outside [0, {g.size()})"
    g.agree(err)
    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    g.handle.broadcast(t, int(src))
    if t is not tensor:
        tensor.copy_(t)
    return _done(async_op)


def destroy_process_group(group=None):
    """Ends moed.init()'s MPI world (and finalises MPI), or moed's world over a torch group
    (group = the ProcessGroup, or None when torch.distributed is initialised and no MPI world
    exists; torch's own group stays: call torch.distributed.destroy_process_group for it). A
    moed.launch group ends with its launch, so for it this is a no-op."""
    from . import _world
    import torch.distributed as tdist
    if isinstance(group, tdist.ProcessGroup):
        _world.close_torch_group(group)
        return
    g = group if group is not None else (getattr(_world._local, "group", None) or _world._mpi_group)
    if g is not None and g is _world._mpi_group:
        shutdown()
        return
    if group is None and g is None:
        _world.close_torch_group(None)
        return
    for key, (pg, tg) in list(_world._torch_groups.items()):
        if tg is g:
            _world.close_torch_group(pg)
