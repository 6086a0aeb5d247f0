"""What every runtime weight format shares: one kernel dispatcher (`dispatch.py`), tensor/row-parallel slicing
(`shard.py`) and expert stacking for grouped GEMMs (`stack.py`). The formats themselves live in
leanlm.model.layers (bf16), leanlm.model.quantized and leanlm.model.sparse."""
