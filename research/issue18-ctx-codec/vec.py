import numpy as np, numba
from numba import types
from numba.extending import intrinsic
from numba.core import cgutils
from llvmlite import ir

def _load64(context, builder, aryty, ary, base):
    arr = context.make_array(aryty)(context, builder, value=ary)
    ptr = builder.gep(arr.data, [base])
    elt = context.get_data_type(aryty.dtype)
    vt = ir.VectorType(elt, 64)
    vptr = builder.bitcast(ptr, vt.as_pointer())
    return builder.load(vptr, align=aryty.dtype.bitwidth // 8), elt, vt

def _splat(builder, vt, x):
    v = ir.Constant(vt, ir.Undefined)
    v = builder.insert_element(v, x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))

@intrinsic
def lt_mask64(typingctx, ary, base, am, T):
    """bits j of (ary[base+j] & am) < T for j < 64 (unsigned)."""
    def codegen(context, builder, sig, args):
        v, elt, vt = _load64(context, builder, sig.args[0], args[0], args[1])
        a = builder.and_(v, _splat(builder, vt, args[2]))
        c = builder.icmp_unsigned("<", a, _splat(builder, vt, args[3]))
        return builder.zext(builder.bitcast(c, ir.IntType(64)), ir.IntType(64))
    return types.uint64(ary, base, am, T), codegen

@intrinsic
def ne_mask64(typingctx, a, b, base):
    """bits j of a[base+j] != b[base+j]."""
    def codegen(context, builder, sig, args):
        va, _, _ = _load64(context, builder, sig.args[0], args[0], args[2])
        vb, _, _ = _load64(context, builder, sig.args[1], args[1], args[2])
        c = builder.icmp_unsigned("!=", va, vb)
        return builder.bitcast(c, ir.IntType(64))
    return types.uint64(a, b, base), codegen

@intrinsic
def slt_mask64(typingctx, ary, base, am, T):
    """as lt_mask64 with a signed compare (valid when am's top bit is clear)."""
    def codegen(context, builder, sig, args):
        v, elt, vt = _load64(context, builder, sig.args[0], args[0], args[1])
        a = builder.and_(v, _splat(builder, vt, args[2]))
        c = builder.icmp_signed("<", a, _splat(builder, vt, args[3]))
        return builder.bitcast(c, ir.IntType(64))
    return types.uint64(ary, base, am, T), codegen

@intrinsic
def bucket_planes(typingctx, ary, base, am, lim, nthr):
    pass
