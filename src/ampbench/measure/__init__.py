"""Measurement, one concern a module: ``clock`` (time on the device), ``memory`` (peaks and the bytes of
activations, parameters and state), ``stats`` (percentiles and intervals; numpy only), ``flops`` (counted
FLOPs and the datasheet peaks), ``sysmon`` (CPU, memory and GPU sampled during training), ``opcount`` (one
training step counted op by op on meta tensors, the optimizer passed in; ``cuda_autocast`` plays CUDA autocast
for it), ``roofline`` (the least step time a datasheet row allows for that count, and its table), ``links`` (the
same on N GPUs of a node: the data-parallel collectives' bytes at their interconnect's bandwidth).

Imports nothing itself, so ``from ampbench.measure import stats`` pulls in no torch.
"""
