"""draftflow.target"""
