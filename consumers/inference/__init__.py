"""consumers/inference"""
