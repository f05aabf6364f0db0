"""Planning: pure arithmetic on sizes and shapes (layouts, model shapes, the memory ledger, units).

Nothing here starts processes or imports `torch.distributed`, so a plan is made on any machine before
anything is launched; every other layer builds on these numbers.
"""
