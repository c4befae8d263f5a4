"""python -m zeroshard.convert CKPT OUT: a zeroshard checkpoint as one ordinary state dict.

CKPT is a checkpoint directory (or the directory holding several, with `latest`, or pick one
with --tag). OUT ends in .safetensors or .pt. The result holds full tensors under the model's
own state-dict names and loads with model.load_state_dict(..., strict=True): the trained
parameters in --dtype, buffers and frozen parameters as the model held them. No GPU and no
process group are needed; tensors are read, checked and written one at a time, so memory
stays bounded by the largest tensor. At a terminal, a line on stderr shows the progress.
"""

import argparse
import io
import os
import pickle
import sys
from collections import OrderedDict

import torch

from zeroshard import _C
from zeroshard._rank import this_rank

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def convert(checkpoint, out, tag=None, dtype="fp32"):
    """Writes checkpoint (a zeroshard checkpoint directory) to out; returns the tensor count."""
    if dtype not in _DTYPES:
        raise ValueError(f"zeroshard.convert: dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    reader = _C.CheckpointReader(os.fspath(checkpoint), tag)
    out = os.fspath(out)
    if out.endswith(".safetensors"):
        return reader.write_safetensors(out, _DTYPES[dtype], progress_rank=this_rank())
    if out.endswith(".pt") or out.endswith(".pth") or out.endswith(".bin"):
        return _write_torch_file(reader, out, _DTYPES[dtype])
    raise ValueError(f"zeroshard.convert: {out!r} must end in .safetensors or .pt")


class _StorageRef:
    """Stands for a tensor's storage in the pickle; torch.load resolves it to data/<key>."""

    def __init__(self, key, dtype, numel):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    def __init__(self, storage, shape):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride, step = [], 1
        for size in reversed(self.shape):
            stride.insert(0, step)
            step *= size
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, torch.Size(self.shape), tuple(stride), False, OrderedDict()))


_STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.bfloat16: "BFloat16Storage", torch.float16: "HalfStorage",
    torch.float64: "DoubleStorage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
}


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            # What torch.save records for a storage; torch.load reads it from data/<key>.
            return ("storage", getattr(torch, _STORAGE_TYPES[obj.dtype]), obj.key, "cpu", obj.numel)
        return None


def _write_torch_file(reader, out, dtype):
    """torch.save's zip format, written a tensor at a time: each tensor's bytes go to their own
    record as soon as they are read, and the pickle of the state dict (which only refers to
    the records) is written last."""
    names = reader.state_dict_names()
    partial = os.path.join(os.path.dirname(out) or ".", "." + os.path.basename(out) + ".partial")
    progress = _C._Progress(f"convert '{reader.path}'", len(names), "tensors", this_rank())
    # The writer puts every record under one archive folder, as torch.save does.
    try:
        writer = torch._C.PyTorchFileWriter(partial)
        state = OrderedDict()
        for i, name in enumerate(names):
            tensor = reader.read(name)
            if reader.is_trained_parameter(name):  # buffers and frozen parameters keep their dtype
                tensor = tensor.to(dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if not tensor.is_contiguous() or tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != nbytes:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            key = str(i)
            writer.write_record(f"data/{key}", tensor.untyped_storage(), nbytes)
            state[name] = _TensorRef(_StorageRef(key, tensor.dtype, tensor.numel()), list(tensor.shape))
            del tensor
            progress.advance(nbytes)
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=2).dump(state)
        data = buffer.getvalue()
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        writer.write_end_of_file()
        os.replace(partial, out)
        progress.finish()
    except BaseException:
        progress.stop()  # the error is printed on a line of its own
        if os.path.exists(partial):
            os.remove(partial)  # never leave a partial file behind
        raise
    return len(names)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m zeroshard.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory, or the save directory holding `latest`")
    parser.add_argument("out", help="output file: *.safetensors or *.pt")
    parser.add_argument("--tag", default=None, help="which checkpoint of the save directory (default: latest)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32",
                        help="dtype of the trained parameters (default fp32, the master weights); buffers "
                             "and frozen parameters keep their own")
    args = parser.parse_args(argv)
    try:
        count = convert(args.checkpoint, args.out, tag=args.tag, dtype=args.dtype)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"zeroshard.convert: {e}", file=sys.stderr)
        return 1
    print(f"wrote {count} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
