"""consumers/trainer"""
