"""jetrl.policy: the model and RL mathematics shared by trainer and inference.

- settings:  the ``[model]`` section (torch-free)
- tokenizer: the tokenizer seam and the character tokenizer (torch-free)
- models:    torchtitan models from jetrl configs, with a KV cache for generation on CPU
- routing:   Router Replay: traces captured at inference, experts forced at training
- sampling:  batched generation for the embedded engine
- loss:      group advantages, the importance-corrected RL loss, mismatch statistics
- schedule:  the learning rate's warmup and decay (torch-free)
- train:     batches of rollouts, logprobs under replay, the train step, determinism
- weights:   safetensors I/O, the weights checksum, Hugging Face names

Import the modules themselves: this package imports nothing, so that the torch-free ones stay so.
"""
