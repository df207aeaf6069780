"""The trainer: Ray Train TorchTrainer workers running DeepSpeed. Algorithm-blind: it receives tokens,
masks and advantages, recomputes old log-probs and applies `dapo_ray.algo.dapo_policy_loss`."""
