"""Pure policy: how the batch, the learning rate and weight decay change during training.

``growth`` (the batch increase function and built-ins), ``interval`` (when it is called),
``global_batch`` (micro-batches for a fixed global batch), ``noise_scale`` (the gradient noise
scale, growth toward it), ``norm_layer_gradients`` (the noise scale on every step), ``lr_scaling`` and ``lr_progress`` (the LR following the batch).
"""
