"""draftflow.report"""
