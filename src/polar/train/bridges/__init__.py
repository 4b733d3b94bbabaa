"""Bridges from polar's rollouts to other trainers' rollout hooks (one module per trainer).

trl  `PolarRollout`, a `rollout_func` for TRL's `GRPOTrainer`, and `polar_reward`, its reward function
"""
