"""Instructions per state element of the kernels one op launches, counted offline: each launch
is compiled for sm_90 with the ptxas that ships with Triton (no GPU needed) and its SASS listed
with cuobjdump. The replay step, the verify and the conventional 8/16-bit kernels are bound by
instruction issue on the H200 (bench/README.md#bounds), so this count ranks
tiles before a GPU run; the GPU sweep decides.

    python3 -m bench.sass_count replay --read fp8_e4m3:row [--checkpoint bf16+sr]
    python3 -m bench.sass_count verify --read fp8_e4m3:row --set qstate.kernels.mamba2.speculative.VERIFY_TILE="{...}"
    python3 -m bench.sass_count conventional --format int8:row
    python3 -m bench.sass_count gdn-conventional --format int8:row
    python3 -m bench.sass_count gdn-replay --read fp8_e4m3:row [--layer kimi-linear-48b-a3b]
    python3 -m bench.sass_count gdn-verify --read fp8_e4m3:row     (gdn-commit: the commit's kernels)

Shapes: the Nemotron-H-8B layer (128 heads × 64 × 128, 8 groups), batch 256, bf16 inputs,
ring 16, T = 4. Per kernel it prints registers, instructions per thread in the listing, and
those times the warps over the elements of one ``[BLOCK_P, BLOCK_N]`` tile: warp-instructions
per state element. A loop's body is listed once (each backward branch's body is printed), so
for the flush kernels (a loop over listed rows) and the grouped step kernel (a loop over heads)
the per-element figure is per iteration; for the gated delta conventional kernel over ``V_LOOP``
tiles a program it is per tile (the body once a tile, the rest once over the tiles).
The ``gdn-*`` ops count the gated delta kernels on the Qwen3.5-122B-A10B layer (``--layer``: any
of ``cases_gated_delta.LAYERS``, Kimi-Linear's with KDA's per-channel gate), tiles
``[BLOCK_V, BLOCK_K]``; the replay step's unrolled sweep is listed whole, its chunk loop once.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU; nothing is launched

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from qstate.kernels.common.launch import replace_kernel  # noqa: E402

from .breakdown import set_constant  # noqa: E402
from .cases_gated_delta import LAYERS, MAIN  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8", torch.uint8: "u8",
          torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_ADDRESSED = re.compile(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][A-Z0-9_.]*[^;]*);")
_BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")
LAYER = dict(nheads=128, headdim=64, dstate=128, ngroups=8)
BATCH = 256


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, kernel, name, launches):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, self.kernel, grid, args, kwargs))


def record(module, names):
    """Replace ``module``'s kernels ``names`` by recorders; returns the list they append to. The
    launchers' register caps apply as on a GPU (on CPU tensors they drop them)."""
    if hasattr(module, "register_cap"):
        module.register_cap = lambda maxnreg, device: {"maxnreg": maxnreg} if maxnreg else {}
    launches = []
    for name in names:
        replace_kernel(module, name, _Recorder(getattr(module, name), name, launches))
    return launches


def compile_sm90(kernel, args, kwargs):
    """Compile one recorded launch for sm_90 (the GPU's conversion instructions on; the fused
    arithmetic as the launch's GPU plan has it)."""
    kwargs = dict(kwargs)
    options = dict(num_warps=kwargs.pop("num_warps", 4))
    if "maxnreg" in kwargs:
        options["maxnreg"] = kwargs.pop("maxnreg")
    if "HW" in kernel.arg_names:  # what a launch on a GPU passes
        kwargs["HW"] = True
    signature, constants, attrs = {}, {}, {}
    values = list(args) + [None] * (len(kernel.arg_names) - len(args))
    for i, name in enumerate(kernel.arg_names):
        value = kwargs[name] if name in kwargs else values[i]
        if name in kwargs or value is None:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and kernel.params[i].do_not_specialize:
            signature[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
        elif isinstance(value, int):
            # Triton specializes 1 and multiples of 16 the same way when it launches.
            if value == 1:
                signature[name], constants[name] = "constexpr", 1
            else:
                signature[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options), options["num_warps"]


def count(compiled):
    """(registers, bytes of shared memory, bytes of local memory (spills), instruction mnemonics,
    loop bodies) of a compiled kernel; a loop body is the number of instructions from a backward
    branch's target to the branch."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin.name], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    registers, local = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "LOCAL"))
    return registers, compiled.metadata.shared, local, _INSTRUCTION.findall(sass), _loop_bodies(sass)


def _loop_bodies(sass):
    """Instructions per backward branch of a listing, from its target to the branch itself."""
    listed = [(int(address, 16), text) for address, text in _ADDRESSED.findall(sass)]
    addresses = [address for address, _ in listed]
    bodies = []
    for address, text in listed:
        branch = _BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            target = int(branch.group(1), 16)
            bodies.append(sum(1 for a in addresses if target <= a <= address))
    return bodies


def _bf16(*shape):
    return torch.randn(*shape, dtype=torch.bfloat16)


def launch_replay(read, checkpoint="fp32"):
    from qstate.cache import ReplayCache
    from qstate.kernels.mamba2 import replay
    launches = record(replay, ["_replay_step_kernel", "_replay_step_grouped_kernel", "_replay_flush_kernel"])
    H, P, N, G = LAYER.values()
    cache = ReplayCache.allocate(BATCH, H, P, N, G, ring_len=16, checkpoint=checkpoint, read=read, device="cpu")
    t = cache.tensors()
    for heads_per_program in (0, replay.DEFAULT_HEADS_PER_PROGRAM):
        replay.launch_replay_decode(
            _bf16(BATCH, H, P), _bf16(BATCH, H), -torch.rand(H), _bf16(BATCH, G, N), _bf16(BATCH, G, N), torch.ones(H),
            _bf16(BATCH, H, P), torch.randn(H), True, None, _bf16(BATCH, H, P),
            *(t[k] for k in ("checkpoint", "checkpoint_scale", "read", "read_scale", "ring_x", "ring_dt", "ring_B",
                             "cursor", "generation", "flush_rows", "flush_counters", "slot_flags")),
            checkpoint_format=cache.checkpoint_format, read_format=cache.read_format, seed=0,
            heads_per_program=heads_per_program)
    return launches


def launch_verify(read, T=4):
    from qstate.cache import ReplayCache
    from qstate.kernels.mamba2 import speculative
    launches = record(speculative, ["_group_BC_kernel", "_verify_kernel", "_verify_flush_kernel",
                                    "_verify_flushed_rows_kernel"])
    H, P, N, G = LAYER.values()
    cache = ReplayCache.allocate(BATCH, H, P, N, G, ring_len=16, read=read, device="cpu", max_draft=T)
    t = cache.tensors()
    speculative.launch_replay_verify(
        _bf16(BATCH, T, H, P), _bf16(BATCH, T, H), -torch.rand(H), _bf16(BATCH, T, G, N), _bf16(BATCH, T, G, N),
        torch.ones(H), _bf16(BATCH, T, H, P), torch.randn(H), True, None, _bf16(BATCH, T, H, P),
        *(t[k] for k in ("checkpoint", "checkpoint_scale", "read", "read_scale", "ring_x", "ring_dt", "ring_B",
                         "cursor", "generation", "drafts", "flush_rows", "flush_counters", "slot_flags")),
        checkpoint_format=cache.checkpoint_format, read_format=cache.read_format, seed=0)
    return launches


def launch_conventional(text):
    from qstate import formats
    from qstate.kernels.common import codec
    from qstate.kernels.mamba2 import conventional
    launches = record(conventional, ["_conventional_kernel"])
    fmt = formats.StateFormat.parse(text)
    H, P, N, G = LAYER.values()
    q = formats.quantize(torch.randn(BATCH, H, P, N), fmt)
    gran = codec.granularity_code(fmt)
    # The GPU's tile (on CPU tensors the launcher would pick the interpreter's).
    block_p, _, num_warps, variant, maxnreg = conventional.launch_config(
        fmt.storage_dtype.itemsize, P, N, gran, BATCH, H, H // G, stochastic=fmt.stochastic, dtype=codec.dtype_code(fmt))
    conventional.launch(
        codec.storage_view(q.data, fmt), q.scale, _bf16(BATCH, H, P), _bf16(BATCH, H), -torch.rand(H),
        _bf16(BATCH, G, N), _bf16(BATCH, G, N), torch.ones(H), _bf16(BATCH, H, P), torch.randn(H), None,
        _bf16(BATCH, H, P), 1, None, dtype_code=codec.dtype_code(fmt), granularity=gran, stochastic=fmt.stochastic,
        qmax=codec.qmax(fmt), emax=codec.emax(fmt), dt_softplus=True, pad_slot_id=-1, heads_per_group=H // G,
        block_p=block_p, num_warps=num_warps, variant=variant, fused=True, maxnreg=maxnreg)
    return launches


def _gpu_plans(module, name="_plan"):
    """Make ``module``'s launch plans those of a GPU launch (its plan ``name`` takes the device)."""
    plan = getattr(module, name)
    setattr(module, name, lambda *a: plan(*(torch.device("cuda") if isinstance(x, torch.device) else x for x in a)))
    from qstate.kernels.common import gpu
    gpu.capability = lambda device: (9, 0)  # the listings are sm_90's, so is the plans' device


def _gdn_token(batch, HK, HV, K, V, gate="scalar"):
    g = -torch.rand(batch, HV, K) if gate == "channel" else -torch.rand(batch, HV)
    return dict(q=_bf16(batch, HK, K), k=_bf16(batch, HK, K), v=_bf16(batch, HV, V), g=g,
                beta=torch.rand(batch, HV).to(torch.bfloat16))


def launch_gdn_conventional(text, batch=BATCH, layer=MAIN):
    import qstate
    from qstate import formats
    from qstate.kernels.gated_delta import conventional
    _gpu_plans(conventional)
    launches = record(conventional, ["_conventional_kernel"])
    HK, HV, K, V, gate = LAYERS[layer]
    fmt = formats.StateFormat.parse(text)
    q = formats.quantize(torch.randn(batch, HV, V, K), fmt)
    qstate.gated_delta_update(q.data, **_gdn_token(batch, HK, HV, K, V, gate), state_scale=q.scale, state_format=text,
                              out=_bf16(batch, HV, V), seed=1)
    return launches


# Multiprocessors of an H100 SXM (the H200 has as many).
H100_SMS = 132


def launch_gdn_replay(read, checkpoint="fp32", batch=BATCH, layer=MAIN):
    import qstate
    from qstate.kernels.gated_delta import replay
    _gpu_plans(replay)
    launches = record(replay, [name for name in vars(replay) if name.startswith("_") and name.endswith("_kernel")])
    HK, HV, K, V, gate = LAYERS[layer]
    cache = qstate.GatedDeltaReplayCache.allocate(batch, HK, HV, K, V, gate=gate, ring_len=16,
                                                  checkpoint=checkpoint, read=read, device="cpu")
    qstate.gated_delta_replay(cache, **_gdn_token(batch, HK, HV, K, V, gate), out=_bf16(batch, HV, V))
    return launches


def launch_gdn_verify(read, T=4, batch=BATCH, layer=MAIN):
    import qstate
    from qstate.kernels.gated_delta import speculative
    _gpu_plans(speculative, "_verify_plan")
    launches = record(speculative, ["_verify_kernel"])
    HK, HV, K, V, gate = LAYERS[layer]
    cache = qstate.GatedDeltaReplayCache.allocate(batch, HK, HV, K, V, gate=gate, ring_len=16, read=read,
                                                  device="cpu", max_draft=T)
    token = _gdn_token(batch * T, HK, HV, K, V, gate)
    drafts = {name: x.reshape(batch, T, *x.shape[1:]) for name, x in token.items()}
    qstate.gated_delta_replay_verify(cache, **drafts, out=_bf16(batch, T, HV, V))
    return launches


def launch_gdn_commit(read, T=4, batch=BATCH, layer=MAIN):
    import qstate
    from qstate.kernels.gated_delta import speculative
    _gpu_plans(speculative, "_commit_plan")
    speculative.gpu.sm_count = lambda device: H100_SMS  # the fold's grid, with no GPU to ask
    launches = record(speculative, ["_commit_list_kernel", "_commit_fold_kernel", "_commit_cursor_kernel"])
    HK, HV, K, V, gate = LAYERS[layer]
    cache = qstate.GatedDeltaReplayCache.allocate(batch, HK, HV, K, V, gate=gate, ring_len=16, read=read,
                                                  device="cpu", max_draft=T)
    c = cache
    speculative.launch_commit(torch.full((batch,), T, dtype=torch.int32), None, c.checkpoint, c.read, c.read_scale,
                              c.ring_k, c.ring_v, c.ring_g, c.ring_beta, c.cursor, c.drafts, c.commit_errors,
                              c.slot_flags,
                              checkpoint_format=cache.checkpoint_format, read_format=cache.read_format, max_draft=T,
                              use_qk_l2norm=True)
    return launches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=("replay", "verify", "conventional", "gdn-conventional", "gdn-replay",
                                            "gdn-verify", "gdn-commit"))
    parser.add_argument("--read", default="fp8_e4m3:row", help="read copy of replay/verify ('none': none)")
    parser.add_argument("--checkpoint", default="fp32", help="checkpoint format of replay")
    parser.add_argument("--format", default="int8:row", help="state format of the conventional kernel")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    parser.add_argument("--mix", type=int, default=0, help="also print the N most frequent instructions")
    parser.add_argument("--layer", default=MAIN, choices=tuple(LAYERS),
                        help="gated delta layer of the gdn-* ops")
    args = parser.parse_args(argv)
    for assignment in args.set:
        set_constant(assignment)
    read = None if args.read == "none" else args.read
    launches = {"replay": lambda: launch_replay(read, args.checkpoint), "verify": lambda: launch_verify(read),
                "conventional": lambda: launch_conventional(args.format),
                "gdn-conventional": lambda: launch_gdn_conventional(args.format, layer=args.layer),
                "gdn-replay": lambda: launch_gdn_replay(read, args.checkpoint, layer=args.layer),
                "gdn-verify": lambda: launch_gdn_verify(read, layer=args.layer),
                "gdn-commit": lambda: launch_gdn_commit(read, layer=args.layer)}[args.op]()
    for name, kernel, grid, call_args, kwargs in launches:
        compiled, num_warps = compile_sm90(kernel, call_args, kwargs)
        registers, shared, local, instructions, bodies = count(compiled)
        line = (f"{name}: grid {grid}, {num_warps} warps, {registers} registers, {shared} B shared, {local} B local, "
                f"{len(instructions)} instructions per thread")
        if bodies:
            line += f" (loop bodies {', '.join(map(str, bodies))})"
        per_tile = len(instructions)
        tiles = kwargs.get("V_LOOP", 1) if name == "_conventional_kernel" else 1
        if tiles > 1 and len(bodies) == 1:
            # V_LOOP tiles a program: the body runs once a tile, the rest once a program.
            per_tile = (len(instructions) - bodies[0]) / tiles + bodies[0]
            line += f", {per_tile:.0f} a tile over {tiles} tiles"
        rows, cols = ("BLOCK_P", "BLOCK_N") if "BLOCK_P" in kwargs else ("BLOCK_V", "BLOCK_K")
        if rows in kwargs:
            tile = kwargs[rows] * kwargs[cols]
            line += (f", tile {kwargs[rows]} x {kwargs[cols]}: "
                     f"{per_tile * num_warps / tile:.3f} warp-instructions per state element")
        print(line, flush=True)
        if args.mix:
            print("   ", collections.Counter(instructions).most_common(args.mix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
