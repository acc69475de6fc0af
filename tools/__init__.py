"""closedloop.tools"""
