"""closedloop.agents"""
