"""The CUDA backend: weights on the GPU, the model as a sequence of kernel launches, CUDA graphs
for decode.  Importing this package needs CuPy; nothing else in kda_rt imports it eagerly."""
