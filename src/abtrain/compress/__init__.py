"""Compressors, each behind the seam its users call: the gradient reducers (``reducer.py``: the seam and the
uncompressed averages; ``powersgd.py``; ``dense.py``: one chosen by name), DDP's communication hook that runs a
reducer (``ddp_hook.py``), and the compression math of the methods that exchange compressed messages: top-k
(``topk.py``), signs with scales (``sign.py``), the chunked DCT (``dct.py``), 4-bit E3M0 codes (``e3m0.py``),
and what travels on the wire (``wire.py``). When and what to send is the methods' policy, not this package's."""
