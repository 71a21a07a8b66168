"""Model fields from encoded tokens: the batch layouts, the instance filter,
the host (numpy and compiled) and jax decodes, sharding into global arrays.
"""
