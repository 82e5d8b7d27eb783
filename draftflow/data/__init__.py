"""draftflow.data"""
