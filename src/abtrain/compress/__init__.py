"""Compressors, each behind the seam its users call.

* Gradient reducers, ``reduce(named_grads, group)`` (``reducer.py``: the seam and the uncompressed averages;
  ``powersgd.py``), and DDP's communication hook that runs one (``ddp_hook.py``): what a method calls to
  average gradients in place (AB-training's ``--ab-dense-comm`` picks one by name: ``methods/ab/dense.py``).
* Codecs, ``encode`` / ``decode`` / ``message_bytes`` (``codec.py``: the interface, float32, bfloat16, int8,
  4-bit E3M0; ``sign.py``: signs with scales; ``topk.py``, ``dct.py`` and ``chunked_topk.py``: the sparse top-k
  formats of EF21, DeMo and SparseLoCo, the last two on ``grid.py``'s chunks, SparseLoCo's with ``twobit.py``'s
  2-bit values and ``bits.py``'s packed positions): a payload's format, moved by the one compressed all-reduce
  (``allreduce.py``) or, sparse, by an all-gather. ``wire.py``: the dtypes a flag may choose for the wire.

When and what to send is the methods' policy, not this package's.
"""
