"""The parallel runtime: process groups over torch.distributed and the tensor-parallel plan."""
