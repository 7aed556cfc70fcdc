"""consumers/recorder"""
