"""closedloop.memory"""
