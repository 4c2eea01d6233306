//! CUDA graphs: the work a stream was given between [`Stream::begin_capture`] and
//! [`Stream::end_capture`], recorded instead of run, then replayed as a whole with one
//! [`Graph::launch`] (no per-kernel launch cost). Only work whose launch path is nothing but
//! stream operations can be captured: kernel launches through `Function::launch_raw`, the
//! `*_raw` copies. The safe copies and `Kernels` query events to release their buffers,
//! which a capture forbids.

use std::fmt;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::driver::{check, Context};
use super::loader;
use super::stream::Stream;
use crate::error::{Error, Result};

fn graphs_supported() -> Result<()> {
    if loader::GRAPH_SYMBOLS.iter().all(|s| loader::has_driver_symbol(s)) {
        Ok(())
    } else {
        Err(Error::Unsupported("this CUDA driver has no graph capture (CUDA 11.4 or later)".into()))
    }
}

impl Stream {
    /// Starts capturing: work queued on this stream from now on is recorded, not run, until
    /// [`end_capture`](Self::end_capture). Relaxed mode: other threads may keep making CUDA
    /// calls meanwhile.
    pub fn begin_capture(&self) -> Result<()> {
        graphs_supported()?;
        let _cur = self.context().enter()?;
        let mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: live stream (non-blocking, so capturable); the symbol was checked above.
        check("cuStreamBeginCapture", unsafe { cu::cuStreamBeginCapture_v2(self.raw(), mode) })
    }

    /// Ends the capture begun by [`begin_capture`](Self::begin_capture) and instantiates
    /// what was recorded. An operation that broke the capture (a synchronizing call on the
    /// stream) fails here.
    pub fn end_capture(&self) -> Result<Graph> {
        graphs_supported()?;
        let _cur = self.context().enter()?;
        let mut graph: cu::CUgraph = ptr::null_mut();
        // SAFETY: live stream; valid out-pointer. The graph is destroyed in Graph's Drop, or
        // just below if instantiation fails.
        check("cuStreamEndCapture", unsafe { cu::cuStreamEndCapture(self.raw(), &mut graph) })?;
        let mut exec: cu::CUgraphExec = ptr::null_mut();
        // SAFETY: `graph` is the graph just captured; valid out-pointer; flags 0.
        let r = unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        if let Err(e) = check("cuGraphInstantiate", r) {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { cu::cuGraphDestroy(graph) };
            return Err(e);
        }
        Ok(Graph { exec, graph, ctx: self.context().clone() })
    }
}

/// A captured, instantiated CUDA graph ([`Stream::end_capture`]); destroyed on drop.
pub struct Graph {
    exec: cu::CUgraphExec,
    graph: cu::CUgraph,
    /// Dropped after the graph is destroyed.
    ctx: Arc<Context>,
}

// SAFETY: graph handles are driver objects usable from any thread; launches of one graph
// are serialized by the caller's `&self` plus the stream's order.
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph").field("ordinal", &self.ctx.ordinal()).finish_non_exhaustive()
    }
}

impl Graph {
    /// Replays the graph on `stream` (of the same device), after the work already queued
    /// there.
    ///
    /// # Safety
    ///
    /// Every address the captured work uses must still be valid, with no conflicting
    /// access, until the replay completes: the graph holds none of its buffers.
    pub unsafe fn launch(&self, stream: &Stream) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: live graph and stream; the caller guarantees the captured addresses.
        check("cuGraphLaunch", unsafe { cu::cuGraphLaunch(self.exec, stream.raw()) })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _cur = self.ctx.enter();
        // SAFETY: created by `end_capture`, destroyed once each; destroying an executable
        // graph whose replay is still running is allowed (the driver defers the release).
        unsafe {
            let _ = cu::cuGraphExecDestroy(self.exec);
            let _ = cu::cuGraphDestroy(self.graph);
        }
    }
}
