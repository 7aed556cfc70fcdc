"""consumers/monitor"""
