/* See shim.h: each function forwards to the libfabric static inline of the same name. */
#include "shim.h"
#include <string.h>

uint32_t fabric_shim_version(void) { return FI_VERSION(1, 17); }

struct fi_info *fabric_shim_fi_allocinfo(void) { return fi_allocinfo(); }

int fabric_shim_fi_domain(struct fid_fabric *fabric, struct fi_info *info,
			  struct fid_domain **domain, void *context)
{
	return fi_domain(fabric, info, domain, context);
}

int fabric_shim_fi_endpoint(struct fid_domain *domain, struct fi_info *info,
			    struct fid_ep **ep, void *context)
{
	return fi_endpoint(domain, info, ep, context);
}

int fabric_shim_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
			   struct fid_cq **cq, void *context)
{
	return fi_cq_open(domain, attr, cq, context);
}

int fabric_shim_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
			   struct fid_av **av, void *context)
{
	return fi_av_open(domain, attr, av, context);
}

int fabric_shim_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags)
{
	return fi_ep_bind(ep, bfid, flags);
}

int fabric_shim_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }

int fabric_shim_fi_getname(fid_t fid, void *addr, size_t *addrlen)
{
	return fi_getname(fid, addr, addrlen);
}

int fabric_shim_fi_av_insert(struct fid_av *av, const void *addr, size_t count,
			     fi_addr_t *fi_addr, uint64_t flags, void *context)
{
	return fi_av_insert(av, addr, count, fi_addr, flags, context);
}

int fabric_shim_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count,
			     uint64_t flags)
{
	return fi_av_remove(av, fi_addr, count, flags);
}

int fabric_shim_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len,
			  uint64_t acs, uint64_t offset, uint64_t requested_key,
			  uint64_t flags, struct fid_mr **mr, void *context)
{
	return fi_mr_reg(domain, buf, len, acs, offset, requested_key, flags, mr,
			 context);
}

/* fi_mr_regattr of CUDA memory: the attribute struct is built here, against the headers of
 * the libfabric being compiled against (2.x puts mr_iov in a union and adds fields). */
int fabric_shim_fi_mr_reg_cuda(struct fid_domain *domain, const void *buf, size_t len,
			       uint64_t acs, uint64_t requested_key, int device,
			       struct fid_mr **mr)
{
	struct iovec iov = { .iov_base = (void *) buf, .iov_len = len };
	struct fi_mr_attr attr;

	memset(&attr, 0, sizeof(attr));
	attr.mr_iov = &iov;
	attr.iov_count = 1;
	attr.access = acs;
	attr.requested_key = requested_key;
	attr.iface = FI_HMEM_CUDA;
	attr.device.cuda = device;
	return fi_mr_regattr(domain, &attr, 0, mr);
}

void *fabric_shim_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }

uint64_t fabric_shim_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }

int fabric_shim_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags)
{
	return fi_mr_bind(mr, bfid, flags);
}

int fabric_shim_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }

int fabric_shim_fi_close(struct fid *fid) { return fi_close(fid); }

ssize_t fabric_shim_fi_writedata(struct fid_ep *ep, const void *buf, size_t len,
				 void *desc, uint64_t data, fi_addr_t dest_addr,
				 uint64_t addr, uint64_t key, void *context)
{
	return fi_writedata(ep, buf, len, desc, data, dest_addr, addr, key, context);
}

ssize_t fabric_shim_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
				uint64_t flags)
{
	return fi_writemsg(ep, msg, flags);
}

ssize_t fabric_shim_fi_write(struct fid_ep *ep, const void *buf, size_t len,
			     void *desc, fi_addr_t dest_addr, uint64_t addr,
			     uint64_t key, void *context)
{
	return fi_write(ep, buf, len, desc, dest_addr, addr, key, context);
}

ssize_t fabric_shim_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc,
			    fi_addr_t src_addr, uint64_t addr, uint64_t key,
			    void *context)
{
	return fi_read(ep, buf, len, desc, src_addr, addr, key, context);
}

ssize_t fabric_shim_fi_send(struct fid_ep *ep, const void *buf, size_t len,
			    void *desc, fi_addr_t dest_addr, void *context)
{
	return fi_send(ep, buf, len, desc, dest_addr, context);
}

ssize_t fabric_shim_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc,
			    fi_addr_t src_addr, void *context)
{
	return fi_recv(ep, buf, len, desc, src_addr, context);
}

ssize_t fabric_shim_fi_cq_read(struct fid_cq *cq, void *buf, size_t count)
{
	return fi_cq_read(cq, buf, count);
}

ssize_t fabric_shim_fi_cq_readfrom(struct fid_cq *cq, void *buf, size_t count,
				   fi_addr_t *src_addr)
{
	return fi_cq_readfrom(cq, buf, count, src_addr);
}

ssize_t fabric_shim_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf,
				  uint64_t flags)
{
	return fi_cq_readerr(cq, buf, flags);
}

const char *fabric_shim_fi_cq_strerror(struct fid_cq *cq, int prov_errno,
				       const void *err_data, char *buf, size_t len)
{
	return fi_cq_strerror(cq, prov_errno, err_data, buf, len);
}

int fabric_shim_fi_control(struct fid *fid, int command, void *arg)
{
	return fi_control(fid, command, arg);
}

int fabric_shim_fi_trywait(struct fid_fabric *fabric, struct fid **fids, int count)
{
	return fi_trywait(fabric, fids, count);
}
