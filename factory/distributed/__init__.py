"""Running a blueprint's parallel layout on torch.distributed (DeviceMesh, FSDP2, DTensor,
``torch.distributed.pipelining``, DCP). Imported only by the training runtime: it imports torch."""
