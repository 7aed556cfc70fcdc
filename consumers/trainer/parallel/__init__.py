"""consumers/trainer/parallel"""
