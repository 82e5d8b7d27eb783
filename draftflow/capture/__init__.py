"""draftflow.capture"""
