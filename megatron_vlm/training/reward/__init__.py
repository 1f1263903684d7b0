"""Reward-model training (`[train] mode = "reward"`): a scalar head on a family backbone, trained with the
Bradley-Terry loss on preference pairs, exported as the folder `[[rl.rewards]] type = "model"` scores with."""
